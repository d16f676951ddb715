"""The elementwise composition kernel (`hypic_rag.kernels.compose_elementwise`: scalar-per-head P of SSD / lightning,
elementwise P of Mamba1, per-channel P) against the naive reference, on random maps and on real spans' maps."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.compose_elementwise import compose_elementwise_batched
from hypic_rag.runtime.ops.compose import compose_batched, compose_in_order, naive_compose
from hypic_rag.runtime.ops.selective_scan import naive_selective_scan, selective_scan_with_transition
from hypic_rag.runtime.ops.ssd import naive_ssd, ssd_with_transition
from kernel_support import DEVICE, STORAGE_DTYPES

TOLERANCE = 1e-5
"""float32 (the kernel may fuse p * s + z into one rounding: a few 1e-7)."""

CASES = {
    # kind, state shape, transition shape
    "scalar per head [H, K, V]": ("scalar", (3, 16, 24), (3, 1, 1)),
    "elementwise [D, N] (Mamba1)": ("vector", (40, 16), (40, 16)),
    "per key channel [H, K, 1]": ("vector", (2, 12, 20), (2, 12, 1)),
    "per channel [D, 1]": ("vector", (33, 5), (33, 1)),
}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float().cpu() - expected.float().cpu()).abs().max() / expected.float().abs().max().clamp_min(1.0))


def random_maps(maps: int, state_shape, transition_shape, seed: int):
    generator = torch.Generator().manual_seed(seed)
    transitions = torch.rand(maps, *transition_shape, generator=generator) * 0.95 + 0.02
    return transitions, torch.randn(maps, *state_shape, generator=generator)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", STORAGE_DTYPES, ids=str)
def test_elementwise_compose_matches_reference(case: str, dtype: torch.dtype) -> None:
    """Several requests (one with no maps), with every intermediate state, maps stored lower and read as stored."""
    kind, state_shape, transition_shape = CASES[case]
    counts = [3, 0, 5, 1]
    transitions, states = random_maps(sum(counts), state_shape, transition_shape, seed=1)
    transitions, states = transitions.to(dtype), states.to(dtype)
    start = torch.randn(len(counts), *state_shape, generator=torch.Generator().manual_seed(2))
    out, steps = compose_elementwise_batched(
        start.to(DEVICE), transitions.to(DEVICE), states.to(DEVICE), counts, store_steps=True
    )
    expected, expected_steps = naive_compose(start, transitions, states, counts, kind=kind, store_steps=True)
    assert out.dtype == steps.dtype == torch.float32 and out.shape == (4, *state_shape)
    assert relative_error(out, expected) <= TOLERANCE
    assert relative_error(steps, expected_steps) <= TOLERANCE
    torch.testing.assert_close(out[1].cpu(), start[1])  # no maps: the start itself


def test_elementwise_compose_zero_start_strided_start_and_addition() -> None:
    _, state_shape, transition_shape = CASES["scalar per head [H, K, V]"]
    transitions, states = random_maps(4, state_shape, transition_shape, seed=3)
    wide = torch.randn(1, 3, 16, 48, generator=torch.Generator().manual_seed(4))
    strided = wide[..., ::2]  # a non-contiguous start state
    out = compose_elementwise_batched(strided.to(DEVICE), transitions.to(DEVICE), states.to(DEVICE), [4])
    assert relative_error(out, naive_compose(strided, transitions, states, [4], kind="scalar")) <= TOLERANCE
    out = compose_elementwise_batched(None, transitions.to(DEVICE), states.to(DEVICE), [4])
    assert relative_error(out, naive_compose(None, transitions, states, [4], kind="scalar")) <= TOLERANCE
    out = compose_elementwise_batched(strided.to(DEVICE), None, states.to(DEVICE), [4])  # `addition`
    assert relative_error(out, strided + states.sum(0)) <= TOLERANCE


def test_ssd_span_maps_compose_to_the_scan_over_the_joined_spans() -> None:
    """Real SSD maps (P = exp(sum dt a) per head) composed by the kernel equal the naive scan over all tokens."""
    generator = torch.Generator().manual_seed(5)
    spans, heads, groups, length, head_dim, state_size = 3, 4, 2, 9, 8, 6
    x = torch.randn(spans, heads, length, head_dim, generator=generator)
    dt = torch.rand(spans, heads, length, generator=generator) * 0.3
    a = -torch.rand(heads, generator=generator) * 0.5 - 0.05
    b = torch.randn(spans, groups, length, state_size, generator=generator)
    c = torch.randn(spans, groups, length, state_size, generator=generator)
    _, _, transition, state = ssd_with_transition(x, dt, a, b, c)
    start = torch.randn(heads, state_size, head_dim, generator=generator)
    out = compose_in_order(start.to(DEVICE), transition[..., None, None].to(DEVICE), state.to(DEVICE), "scalar",
                           backend="triton")
    joined = [t.transpose(0, 1).reshape(1, t.shape[1], -1, *t.shape[3:]) for t in (x, dt, b, c)]
    _, expected = naive_ssd(joined[0], joined[1], a, joined[2], joined[3], None, start[None])
    assert relative_error(out, expected[0]) <= 1e-4  # two float32 paths of 27 steps


def test_mamba1_span_maps_compose_to_the_scan_over_the_joined_spans() -> None:
    """Real selective-scan maps (P [D, N] elementwise) composed for two requests in one launch."""
    generator = torch.Generator().manual_seed(6)
    spans, channels, length, state_size = 4, 12, 7, 5
    x = torch.randn(spans, channels, length, generator=generator)
    dt = torch.rand(spans, channels, length, generator=generator) * 0.3
    a = -torch.rand(channels, state_size, generator=generator) - 0.1
    b = torch.randn(spans, length, state_size, generator=generator)
    c = torch.randn(spans, length, state_size, generator=generator)
    _, _, transition, state = selective_scan_with_transition(x, dt, a, b, c)
    starts = torch.randn(2, channels, state_size, generator=generator)
    out = compose_batched(starts.to(DEVICE), transition.to(DEVICE), state.to(DEVICE), [1, 3], "vector", backend="triton")
    for request, rows in enumerate((slice(0, 1), slice(1, 4))):
        joined = [t[rows].permute(1, 0, 2).reshape(1, channels, -1) for t in (x, dt)]
        joined += [t[rows].reshape(1, -1, state_size) for t in (b, c)]
        _, expected = naive_selective_scan(joined[0], joined[1], a, joined[2], joined[3], None, starts[request : request + 1])
        assert relative_error(out[request], expected[0]) <= 1e-4


def test_elementwise_compose_rejects_mismatched_inputs() -> None:
    transitions, states = random_maps(3, (2, 4, 4), (2, 1, 1), seed=7)
    with pytest.raises(ValueError, match="sum to the 3 maps"):
        compose_elementwise_batched(None, transitions.to(DEVICE), states.to(DEVICE), [1, 1])
    with pytest.raises(ValueError, match="do not broadcast"):
        compose_elementwise_batched(None, transitions[:, :, :, :1].expand(3, 2, 3, 1).to(DEVICE), states.to(DEVICE), [3])
    with pytest.raises(ValueError, match="must be"):
        compose_elementwise_batched(None, None, torch.zeros(3, 4, device=DEVICE), [3])
