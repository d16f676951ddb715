"""The CUDA path (fla's Triton kernel) against the naive float32 reference. Skipped without CUDA and fla."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    gated_delta_rule_with_transition,
    naive_recurrent_gated_delta_rule,
)
from hypic_rag.kernels.gated_delta_rule import fla_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not fla_available(), reason="needs CUDA and flash-linear-attention")]


def inputs(length: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(2, 4, length, 64, generator=generator), dim=-1) * 64**-0.5
    k = torch.nn.functional.normalize(torch.randn(2, 4, length, 64, generator=generator), dim=-1)
    v = torch.randn(2, 4, length, 64, generator=generator)
    g = -torch.rand(2, 4, length, generator=generator) * 0.5
    b = torch.rand(2, 4, length, generator=generator)
    s = torch.randn(2, 4, 64, 64, generator=generator)
    return q, k, v, g, b, s


@pytest.mark.parametrize("length", [1, 63, 200])
def test_fla_matches_naive(length: int) -> None:
    q, k, v, g, b, s = inputs(length)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    output, state = chunk_gated_delta_rule(*(x.cuda() for x in (q, k, v, g, b, s)))
    # TF32 tensor-core matmuls inside the kernel: looser than the fp32 CPU path
    torch.testing.assert_close(output.cpu(), expected_output, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(state.cpu(), expected_state, atol=2e-3, rtol=2e-3)


def test_fla_transition_operator() -> None:
    q, k, v, g, b, s = inputs(130, seed=1)
    _, _, span = gated_delta_rule_with_transition(*(x.cuda() for x in (q, k, v, g, b)))
    _, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    torch.testing.assert_close(span.apply(s.cuda()).cpu(), expected_state, atol=2e-3, rtol=2e-3)
