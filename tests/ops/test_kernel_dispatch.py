"""Which path the runtime takes: the CPU path never loads the Triton kernel modules, HYPIC_RAG_KERNELS switches
them, the gated-delta-rule dispatch (and its varlen entry point) on CPU, and `hypic_rag.kernels` from a source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hypic_rag.kernels import kernel_mode, triton_enabled
from hypic_rag.runtime.ops.gated_delta_rule import (
    gated_delta_rule_varlen,
    naive_recurrent_gated_delta_rule,
    select_backend,
)
import itertools

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, *extra: str, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(
        [sys.executable, *extra, "-c", code], capture_output=True, text=True, cwd="/", timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", **(env or {})},
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout.strip()


def test_cpu_prefill_never_loads_the_triton_kernels() -> None:
    code = (
        "import sys, torch\n"
        "from hypic_rag.runtime.engine import Engine\n"
        "from hypic_rag.runtime.model import wrap_model\n"
        "from hypic_rag.runtime.request import Request\n"
        "from hypic_rag.testing import build_tiny_model\n"
        "engine = Engine(wrap_model(build_tiny_model('qwen3_5', num_hidden_layers=4)), seam_tokens=2)\n"
        "request = Request([1, 2, 3], [[4, 5, 6, 7, 8], [9, 10, 11, 12]], [13, 14])\n"
        "for mode in ('full', 'prefix', 'addition', 'transition', 'transition_rope', 'hypic'):\n"
        "    engine.prefill(request, mode)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('hypic_rag.kernels.', 'fla'))))\n"
    )
    assert run_python(code, env={"HYPIC_RAG_KERNELS": "auto"}) == "[]"


def test_kernel_switch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.zeros(1)
    monkeypatch.delenv("HYPIC_RAG_KERNELS", raising=False)
    assert kernel_mode() == "auto" and not triton_enabled(cpu)  # auto: CUDA tensors only
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "triton")
    assert triton_enabled(cpu)  # asked for: on CPU that means the interpreter
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "torch")
    assert not triton_enabled(cpu)
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "cuda-please")
    with caplog.at_level("WARNING", logger="hypic_rag.kernels"):
        assert kernel_mode() == "auto"
    assert "HYPIC_RAG_KERNELS='cuda-please' is not one of auto, torch, triton" in caplog.text


def test_cpu_backends() -> None:
    assert select_backend(torch.zeros(1, 2, 1, 16)) == "recurrent"
    assert select_backend(torch.zeros(1, 2, 40, 16)) == "chunk"


def test_varlen_equals_each_sequence_alone() -> None:
    generator = torch.Generator().manual_seed(0)
    bounds = [0, 5, 5, 17, 18]  # an empty sequence and a one-token one among them
    heads, total, key_dim, value_dim = 2, bounds[-1], 8, 12
    q = torch.nn.functional.normalize(torch.randn(1, heads, total, key_dim, generator=generator), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(1, heads, total, key_dim, generator=generator), dim=-1)
    v = torch.randn(1, heads, total, value_dim, generator=generator)
    g = -torch.rand(1, heads, total, generator=generator) * 0.3
    b = torch.rand(1, heads, total, generator=generator)
    start = torch.randn(4, heads, key_dim, value_dim, generator=generator)
    output, finals = gated_delta_rule_varlen(q, k, v, g, b, bounds, start)
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        parts = (x[:, :, begin:end] for x in (q, k, v, g, b))
        expected_output, expected_final = naive_recurrent_gated_delta_rule(*parts, start[number : number + 1])
        torch.testing.assert_close(output[:, :, begin:end], expected_output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[number : number + 1], expected_final, atol=1e-5, rtol=1e-5)
    _, zero_start = gated_delta_rule_varlen(q, k, v, g, b, torch.tensor(bounds))
    assert zero_start.shape == (4, heads, key_dim, value_dim) and bool((zero_start[1] == 0).all())
    with pytest.raises(ValueError, match="must run from 0"):
        gated_delta_rule_varlen(q, k, v, g, b, [0, 5, 17])
    with pytest.raises(ValueError, match="non-decreasing"):
        gated_delta_rule_varlen(q, k, v, g, b, [0, 9, 5, 18])
    with pytest.raises(ValueError, match="start states"):
        gated_delta_rule_varlen(q, k, v, g, b, bounds, start[:2])


def test_source_tree_kernels_without_an_install() -> None:
    """`PYTHONPATH=<checkout>` alone (how scripts/gpu_check.sh runs): hypic_rag.kernels is the checkout's hypic_rag/kernels/,
    also with site-packages off (-S: no editable install of another checkout to fall back on)."""
    expected = str(ROOT / "hypic_rag" / "kernels" / "__init__.py")
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import hypic_rag.kernels as k; print(k.__file__)"
    assert run_python(code, "-S") == expected
    assert run_python("import hypic_rag.kernels.gated_delta_rule as g; print(g.__file__)") == str(
        ROOT / "hypic_rag" / "kernels" / "gated_delta_rule.py"
    )


def test_rotary_tables_give_mrope_modules_three_position_streams() -> None:
    """transformers 5.17 (the GPU check machine's) needs M-RoPE position ids as [3, batch, T]; a [1, T] tensor made
    every prefill fail there. The tables must equal the model's own for text positions either way."""
    from hypic_rag.runtime import layers as L
    from hypic_rag.testing import build_tiny_model

    for model_type in ("qwen3_5", "qwen3_next"):
        rotary = build_tiny_model(model_type, num_hidden_layers=1).model.rotary_emb
        seen: list[tuple[int, ...]] = []
        original = rotary.forward

        def strict(x, position_ids, original=original, seen=seen):
            seen.append(tuple(position_ids.shape))
            return original(x, position_ids)

        rotary.forward = strict
        cos, sin = L.rotary_tables(rotary, torch.arange(12), torch.zeros(1))
        expected = (3, 1, 12) if hasattr(rotary, "mrope_section") else (1, 12)
        assert seen == [expected] and cos.shape[0] == sin.shape[0] == 12
        plain_cos, _ = original(torch.zeros(1), torch.arange(12)[None])
        torch.testing.assert_close(cos, plain_cos[0])
