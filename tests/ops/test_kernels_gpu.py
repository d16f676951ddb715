"""The CUDA path of the gated delta rule (fla's Triton kernels, through the runtime's dispatch) against the naive
float32 reference. Skipped without CUDA and fla (scripts/gpu_check.sh runs it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.gated_delta_rule import fla_available
from hypic_rag.runtime.ops.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_rule_varlen,
    gated_delta_rule_with_transition,
    naive_recurrent_gated_delta_rule,
    select_backend,
)
import itertools

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_available(), reason="needs CUDA and flash-linear-attention")]

RELATIVE_TOLERANCE = 1e-2
"""Max error over max magnitude: fla's kernels multiply float32 in TF32 on tensor cores (10-bit mantissa), so they
are looser than the float32 CPU path; a wrong layout, scale or start state is off by O(1)."""


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = float((actual.float().cpu() - expected).abs().max() / expected.abs().max().clamp_min(1.0))
    assert error <= RELATIVE_TOLERANCE, f"relative error {error:.2e}"


def inputs(length: int, seed: int = 0, batch: int = 1, heads: int = 16, key_dim: int = 128, value_dim: int = 128):
    """Qwen3.5's linear-layer head shape (16 heads of 128), so the kernels fla compiles and autotunes here are the
    ones the GPU benchmark reuses (scripts/gpu_check.sh runs both on one machine, autotuning is minutes per shape)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1)
    v = torch.randn(batch, heads, length, value_dim, generator=generator)
    g = -torch.rand(batch, heads, length, generator=generator) * 0.5
    b = torch.rand(batch, heads, length, generator=generator)
    s = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return q, k, v, g, b, s


@pytest.mark.parametrize("length, backend", [(1, "fla_recurrent"), (3, "fla_recurrent"), (63, "fla"), (200, "fla")])
def test_fla_matches_naive(length: int, backend: str) -> None:
    q, k, v, g, b, s = inputs(length)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    cuda = [x.cuda() for x in (q, k, v, g, b, s)]
    assert select_backend(cuda[0]) == backend
    output, state = gated_delta_rule(*cuda)
    assert output.dtype == state.dtype == torch.float32
    assert_near(output, expected_output)
    assert_near(state, expected_state)


def test_fla_transition_operator() -> None:
    """The identity-start trick through fla (value width V + K = 256): P and Z compose to the real end state."""
    q, k, v, g, b, s = inputs(130, seed=1)
    _, _, span = gated_delta_rule_with_transition(*(x.cuda() for x in (q, k, v, g, b)))
    _, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    assert_near(span.apply(s.cuda()), expected_state)


@pytest.mark.parametrize("bounds", [[0, 8, 16, 19, 27], [0, 1, 3, 4], [0, 70, 75, 200]])
def test_fla_varlen_matches_each_sequence(bounds: list[int]) -> None:
    """Batched seams: sequences packed along time, each from its own start state (fused recurrent when all are
    short, chunked otherwise)."""
    q, k, v, g, b, _ = inputs(bounds[-1], seed=2, batch=1)
    starts = torch.randn(len(bounds) - 1, 16, 128, 128, generator=torch.Generator().manual_seed(3))
    output, finals = gated_delta_rule_varlen(*(x.cuda() for x in (q, k, v, g, b)), bounds, starts.cuda())
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        parts = (x[:, :, begin:end] for x in (q, k, v, g, b))
        expected_output, expected_final = naive_recurrent_gated_delta_rule(*parts, starts[number : number + 1])
        assert_near(output[:, :, begin:end], expected_output)
        assert_near(finals[number : number + 1], expected_final)
