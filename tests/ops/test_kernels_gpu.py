"""The CUDA path of every recurrence fla runs (gated delta rule, KDA, simple GLA for SSD and lightning), through the
runtime's own dispatches, against the naive float32 references: plain, from a start state, the identity-start
transition operator, and packed sequences (`cu_seqlens`). Skipped without CUDA and flash-linear-attention
(scripts/gpu_check.sh runs it on a GPU).

Head shapes are those of the GPU benchmark's ~2B models (`hypic_rag.bench.gpu_models`), so the kernels fla compiles
and autotunes here are the ones the benchmark reuses (scripts/gpu_check.sh runs both on one machine; fla's
autotuning is keyed by heads and head sizes and costs tens of seconds per new shape)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.gated_delta_rule import (
    gated_delta_rule,
    gated_delta_rule_varlen,
    gated_delta_rule_with_transition,
    naive_recurrent_gated_delta_rule,
    select_backend,
)
from hypic_rag.runtime.ops.kda import kda, kda_varlen, kda_with_transition, naive_recurrent_kda, select_kda_backend
from hypic_rag.runtime.ops.lightning import (
    lightning_attention,
    lightning_attention_varlen,
    naive_recurrent_lightning,
    select_lightning_backend,
)
from hypic_rag.runtime.ops.ssd import naive_ssd, select_backend as select_ssd_backend, ssd, ssd_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

RELATIVE_TOLERANCE = 1e-2
"""Max error over max magnitude: fla's kernels multiply float32 in TF32 on tensor cores (10-bit mantissa), so they
are looser than the float32 CPU path; a wrong layout, scale, decay or start state is off by O(1)."""

LENGTHS = [(1, "fla_recurrent"), (3, "fla_recurrent"), (63, "fla"), (200, "fla")]
BOUNDS = [[0, 8, 16, 19, 27], [0, 1, 3, 4], [0, 70, 75, 200]]


def needs_fla(op: str):
    return pytest.mark.skipif(not backends.fla_ready(op), reason=f"needs flash-linear-attention's {op}")


def assert_near(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = float((actual.float().cpu() - expected).abs().max() / expected.abs().max().clamp_min(1.0))
    assert error <= RELATIVE_TOLERANCE, f"relative error {error:.2e}"


def delta_inputs(length: int, seed: int, heads: int, key_dim: int = 128, value_dim: int = 128, per_channel: bool = False):
    """q, k, v, log decay ([B, H, T] or per key channel [B, H, T, K]), beta, start: the delta rules' inputs."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, heads, length, key_dim, generator=generator), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(1, heads, length, key_dim, generator=generator), dim=-1)
    v = torch.randn(1, heads, length, value_dim, generator=generator)
    g = -torch.rand(1, heads, length, *((key_dim,) if per_channel else ()), generator=generator) * 0.5
    b = torch.rand(1, heads, length, generator=generator)
    s = torch.randn(1, heads, key_dim, value_dim, generator=generator)
    return q, k, v, g, b, s


# Gated DeltaNet: Qwen3.5-2B's 16 heads of 128
@needs_fla("gated_delta_rule")
@pytest.mark.parametrize("length, backend", LENGTHS)
def test_gated_delta_rule_through_fla(length: int, backend: str) -> None:
    q, k, v, g, b, s = delta_inputs(length, 0, heads=16)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    cuda = [x.cuda() for x in (q, k, v, g, b, s)]
    assert select_backend(cuda[0]) == backend
    output, state = gated_delta_rule(*cuda)
    assert output.dtype == state.dtype == torch.float32
    assert_near(output, expected_output)
    assert_near(state, expected_state)


@needs_fla("gated_delta_rule")
def test_gated_delta_rule_transition_operator_through_fla() -> None:
    """The identity-start trick through fla (value width V + K = 256): P and Z compose to the real end state."""
    q, k, v, g, b, s = delta_inputs(130, 1, heads=16)
    _, _, span = gated_delta_rule_with_transition(*(x.cuda() for x in (q, k, v, g, b)))
    _, expected_state = naive_recurrent_gated_delta_rule(q, k, v, g, b, s)
    assert_near(span.apply(s.cuda()), expected_state)


@needs_fla("gated_delta_rule")
@pytest.mark.parametrize("bounds", BOUNDS)
def test_gated_delta_rule_varlen_through_fla(bounds: list[int]) -> None:
    q, k, v, g, b, _ = delta_inputs(bounds[-1], 2, heads=16)
    starts = torch.randn(len(bounds) - 1, 16, 128, 128, generator=torch.Generator().manual_seed(3))
    output, finals = gated_delta_rule_varlen(*(x.cuda() for x in (q, k, v, g, b)), bounds, starts.cuda())
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        parts = (x[:, :, begin:end] for x in (q, k, v, g, b))
        expected_output, expected_final = naive_recurrent_gated_delta_rule(*parts, starts[number : number + 1])
        assert_near(output[:, :, begin:end], expected_output)
        assert_near(finals[number : number + 1], expected_final)


# KDA: Kimi-Linear's 32 heads of 128
@needs_fla("kda")
@pytest.mark.parametrize("length, backend", LENGTHS)
def test_kda_through_fla(length: int, backend: str) -> None:
    q, k, v, g, b, s = delta_inputs(length, 4, heads=32, per_channel=True)
    expected_output, expected_state = naive_recurrent_kda(q, k, v, g, b, s)
    cuda = [x.cuda() for x in (q, k, v, g, b, s)]
    assert select_kda_backend(cuda[0]) == backend
    output, state = kda(*cuda)
    assert_near(output, expected_output)
    assert_near(state, expected_state)


@needs_fla("kda")
def test_kda_transition_operator_and_varlen_through_fla() -> None:
    q, k, v, g, b, s = delta_inputs(130, 5, heads=32, per_channel=True)
    _, _, span = kda_with_transition(*(x.cuda() for x in (q, k, v, g, b)))
    assert_near(span.apply(s.cuda()), naive_recurrent_kda(q, k, v, g, b, s)[1])
    bounds = BOUNDS[2]
    q, k, v, g, b, _ = delta_inputs(bounds[-1], 6, heads=32, per_channel=True)
    starts = torch.randn(len(bounds) - 1, 32, 128, 128, generator=torch.Generator().manual_seed(7))
    output, finals = kda_varlen(*(x.cuda() for x in (q, k, v, g, b)), bounds, starts.cuda())
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        expected_output, expected_final = naive_recurrent_kda(
            *(x[:, :, begin:end] for x in (q, k, v, g, b)), starts[number : number + 1])
        assert_near(output[:, :, begin:end], expected_output)
        assert_near(finals[number : number + 1], expected_final)


# SSD (simple GLA): Granite-4.0-H's 48 heads of 64, state 128, one group
def ssd_inputs(length: int, seed: int, heads: int = 48, groups: int = 1, head_dim: int = 64, state_size: int = 128):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, heads, length, head_dim, generator=generator)
    dt = torch.nn.functional.softplus(torch.randn(1, heads, length, generator=generator) - 1.0)
    a = -torch.linspace(0.5, 4.0, heads)
    b = torch.randn(1, groups, length, state_size, generator=generator) * state_size**-0.5
    c = torch.randn(1, groups, length, state_size, generator=generator) * state_size**-0.5
    d = torch.randn(heads, generator=generator)
    start = torch.randn(1, heads, state_size, head_dim, generator=generator)
    return x, dt, a, b, c, d, start


@needs_fla("simple_gla")
@pytest.mark.parametrize("length, backend", LENGTHS)
def test_ssd_through_fla_simple_gla(length: int, backend: str) -> None:
    x, dt, a, b, c, d, start = ssd_inputs(length, 8)
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    cuda = [t.cuda() for t in (x, dt, a, b, c, d, start)]
    assert select_ssd_backend(cuda[0]) == backend
    output, state = ssd(*cuda)
    assert_near(output, expected_output)
    assert_near(state, expected_state)


@needs_fla("simple_gla")
def test_ssd_varlen_through_fla_with_groups() -> None:
    bounds = BOUNDS[0]
    x, dt, a, b, c, d, _ = ssd_inputs(bounds[-1], 9, heads=16, groups=4)
    starts = torch.randn(len(bounds) - 1, 16, 128, 64, generator=torch.Generator().manual_seed(10))
    output, finals = ssd_varlen(*(t.cuda() for t in (x, dt, a, b, c)), bounds, d.cuda(), starts.cuda())
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        expected_output, expected_final = naive_ssd(x[:, :, begin:end], dt[:, :, begin:end], a, b[:, :, begin:end],
                                                    c[:, :, begin:end], d, starts[number : number + 1])
        assert_near(output[:, :, begin:end], expected_output)
        assert_near(finals[number : number + 1], expected_final)


# lightning (simple GLA, constant decay per head): the benchmark MiniMax's 16 heads of 128
@needs_fla("simple_gla")
@pytest.mark.parametrize("length, backend", LENGTHS)
def test_lightning_through_fla_simple_gla(length: int, backend: str) -> None:
    generator = torch.Generator().manual_seed(11)
    heads, dim = 16, 128
    q, k, v = (torch.nn.functional.silu(torch.randn(1, heads, length, dim, generator=generator)) * dim**-0.5
               for _ in range(3))
    slopes = -torch.linspace(0.01, 0.8, heads)[:, None]  # [H, 1]
    start = torch.randn(1, heads, dim, dim, generator=generator)
    expected_output, expected_state = naive_recurrent_lightning(q, k, v, slopes, start)
    cuda = [t.cuda() for t in (q, k, v, slopes, start)]
    assert select_lightning_backend(cuda[0]) == backend
    output, state = lightning_attention(*cuda)
    assert_near(output, expected_output)
    assert_near(state, expected_state)
    bounds = [0, length // 2, length]
    starts = torch.randn(2, heads, dim, dim, generator=generator)
    output, finals = lightning_attention_varlen(*cuda[:4], bounds, starts.cuda())
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        parts = (t[:, :, begin:end] for t in (q, k, v))
        expected_output, expected_final = naive_recurrent_lightning(*parts, slopes, starts[number : number + 1])
        assert_near(output[:, :, begin:end], expected_output)
        assert_near(finals[number : number + 1], expected_final)
