"""The GPU benchmark (`hypic_rag.bench.gpu`, run by scripts/gpu_check.sh) end to end on a tiny model on CPU: it must
run as it is on the GPU machine, where nobody can fix it mid-run."""

from __future__ import annotations

import json
from pathlib import Path

from hypic_rag.bench.gpu import SHAPES, main


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
    markdown = (tmp_path / "gpu_bench.md").read_text()
    assert "| hypic (resident) |" in markdown and "Target (issue 16)" in markdown


def test_the_2b_shape_is_2b() -> None:
    from hypic_rag.testing import tiny_config

    config = tiny_config("qwen3_5", **SHAPES["2b"])
    hidden, layers = config.hidden_size, config.num_hidden_layers
    linear = config.layer_types.count("linear_attention")
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    per_linear = hidden * (2 * key_dim + 2 * value_dim) + value_dim * hidden
    per_attention = hidden * config.num_attention_heads * config.head_dim * 3 + 2 * hidden * config.num_key_value_heads * config.head_dim
    mlp = 3 * hidden * config.intermediate_size
    total = linear * per_linear + (layers - linear) * per_attention + layers * mlp + 2 * config.vocab_size * hidden
    assert (linear, layers - linear) == (18, 6)
    assert 1.6e9 < total < 2.4e9
