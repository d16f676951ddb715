"""Packed sequences (`cu_seqlens`) for every head-major op, on the CPU path (one call per sequence), against each
sequence run alone through the naive reference; and on CPU the dispatches never pick fla. The CUDA side (fla's
varlen kernels) is tests/ops/test_kernels_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.gated_delta_rule import select_backend as select_gated_delta_rule_backend
from hypic_rag.runtime.ops.kda import kda_varlen, naive_recurrent_kda, select_kda_backend
from hypic_rag.runtime.ops.lightning import lightning_attention_varlen, naive_recurrent_lightning, select_lightning_backend
from hypic_rag.runtime.ops.ssd import select_backend as select_ssd_backend

BOUNDS = [0, 6, 6, 19, 20]
"""Four sequences: one of 6, an empty one, one of 13 and one of a single token."""


def head_major(*shapes, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator) for shape in shapes]


def assert_each_sequence(output, finals, starts, naive, packed) -> None:
    for number, (begin, end) in enumerate(itertools.pairwise(BOUNDS)):
        parts = [x[:, :, begin:end] for x in packed]
        expected_output, expected_final = naive(*parts, starts[number : number + 1])
        torch.testing.assert_close(output[:, :, begin:end], expected_output, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[number : number + 1], expected_final, atol=1e-5, rtol=1e-5)


def test_kda_varlen_equals_each_sequence_alone() -> None:
    heads, total, key_dim, value_dim = 2, BOUNDS[-1], 8, 6
    q, k, v, g, b, starts = head_major((1, heads, total, key_dim), (1, heads, total, key_dim), (1, heads, total, value_dim),
                                       (1, heads, total, key_dim), (1, heads, total), (4, heads, key_dim, value_dim), seed=0)
    q = torch.nn.functional.normalize(q, dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(k, dim=-1)
    g, b = -g.abs() * 0.3, b.sigmoid()
    output, finals = kda_varlen(q, k, v, g, b, BOUNDS, starts)
    assert_each_sequence(output, finals, starts, naive_recurrent_kda, (q, k, v, g, b))
    torch.testing.assert_close(finals[1], starts[1])  # the empty sequence keeps its start
    with pytest.raises(ValueError, match="non-decreasing"):
        kda_varlen(q, k, v, g, b, [0, 9, 5, 20])


def test_lightning_varlen_equals_each_sequence_alone() -> None:
    heads, total, dim = 3, BOUNDS[-1], 5
    q, k, v, starts = head_major((1, heads, total, dim), (1, heads, total, dim), (1, heads, total, dim),
                                 (4, heads, dim, dim), seed=1)
    slopes = -torch.tensor([[0.1], [0.3], [0.9]])  # [H, 1]: MiniMax's constant decay per head
    output, finals = lightning_attention_varlen(q, k, v, slopes, torch.tensor(BOUNDS), starts)
    decay = slopes.expand(1, heads, total)
    assert_each_sequence(output, finals, starts, naive_recurrent_lightning, (q, k, v, decay))
    with pytest.raises(ValueError, match="start states"):
        lightning_attention_varlen(q, k, v, slopes, BOUNDS, starts[:2])


def test_cpu_dispatches_never_pick_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "auto")
    few, many = torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 40, 8)
    for select in (select_gated_delta_rule_backend, select_kda_backend, select_lightning_backend, select_ssd_backend):
        assert (select(few), select(many)) == ("recurrent", "chunk")
    for op in backends.FLA_OPS:
        assert not backends.use_fla(few, op)
    with pytest.raises(ValueError, match="unknown fla op"):
        backends.fla_ready("mamba")


def test_the_cuda_kernel_table_names_every_mixer_kind() -> None:
    assert set(backends.CUDA_KERNELS) == {
        "gated_deltanet", "kda", "ssd", "lightning", "selective_scan", "short_conv", "attention",
    }
    for kind in ("gated_deltanet", "kda", "ssd", "lightning"):
        assert backends.CUDA_KERNELS[kind]["recurrence"].startswith("fla ")
