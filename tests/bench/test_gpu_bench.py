"""The GPU benchmark (`hypic_rag.bench.gpu`, run by scripts/gpu_check.sh) end to end on a tiny model on CPU: it must
run as it is on the GPU machine, where nobody can fix it mid-run."""

from __future__ import annotations

import json
from pathlib import Path

from hypic_rag.bench.gpu import SHAPES, main, markdown


def test_gpu_benchmark_runs_and_reports(tmp_path: Path) -> None:
    argv = [
        "--output", str(tmp_path), "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--ks", "2", "3",
        "--chunk-tokens", "12", "--prefix-tokens", "4", "--question-tokens", "3", "--repeats", "1",
    ]
    assert main(argv) == 0
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    modes = {"transformers", "full", "prefix", "transition_rope", "hypic", "transition_rope (resident)", "hypic (resident)"}
    assert [row["k"] for row in result["ttft"]] == [2, 3]
    for row in result["ttft"]:
        assert set(row["ttft_seconds"]) == modes and all(value > 0 for value in row["ttft_seconds"].values())
        assert row["stats"]["prefix"]["prefix_reused_tokens"] == 4 + 12  # the prefix and the shared first chunk
        assert row["stats"]["transition_rope"]["recomputed_tokens"] == 3  # the question only
        assert row["stats"]["hypic"]["recomputed_tokens"] == 3 + row["k"] * 8  # every chunk's 8-token seam
    assert result["target"]["k"] == 3 and result["kernels"]["compose_torch_us"] > 0
    report = (tmp_path / "gpu_bench.md").read_text()
    assert "| hypic (resident) |" in report and "Target: hypic" in report
    partial = {name: value for name, value in result.items() if name not in ("target", "kernels")}
    assert "Partial: 2 of 2 prompt sizes" in markdown(partial)  # what a run stopped by its time limit leaves


def test_the_2b_shape_is_2b() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hypic_rag.testing import tiny_config

    config = tiny_config("qwen3_5", **SHAPES["2b"])
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    assert (config.layer_types.count("linear_attention"), config.layer_types.count("full_attention")) == (18, 6)
    assert 1.8e9 < parameters < 2.0e9
