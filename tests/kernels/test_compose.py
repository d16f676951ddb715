"""The composition kernel (`hypic_rag.kernels.compose`) against its torch reference and against the delta rule."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.compose import compose_affine, compose_affine_batched
from hypic_rag.runtime.ops.compose import naive_compose
from hypic_rag.runtime.ops.gated_delta_rule import gated_delta_rule_with_transition, naive_recurrent_gated_delta_rule

from kernel_support import DEVICE, STORAGE_DTYPES

TOLERANCE = 1e-5 if DEVICE == "cpu" else 5e-5
"""float32 target of issue 16 (interpreter); on a GPU the kernel's products are 3xTF32 (a few 1e-7 each)."""


def chunk_maps(chunks: int, heads: int, key_dim: int, value_dim: int, length: int = 12, seed: int = 0):
    """Real (P, Z) pairs: `chunks` random spans run through the delta rule from the identity start.
    Returns transitions [chunks, H, K, K], states [chunks, H, K, V] and the spans' inputs."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(chunks, heads, length, key_dim, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(chunks, heads, length, key_dim, generator=generator), dim=-1)
    v = torch.randn(chunks, heads, length, value_dim, generator=generator)
    g = -torch.rand(chunks, heads, length, generator=generator) * 0.2
    b = torch.rand(chunks, heads, length, generator=generator)
    _, _, maps = gated_delta_rule_with_transition(q, k, v, g, b)
    return maps.transition, maps.state, (q, k, v, g, b)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float().cpu() - expected.float().cpu()).abs().max() / expected.float().abs().max().clamp_min(1.0))


@pytest.mark.parametrize("dtype", STORAGE_DTYPES, ids=str)
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_compose_matches_reference(dtype: torch.dtype, chunks: int) -> None:
    transitions, states, _ = chunk_maps(chunks, heads=2, key_dim=16, value_dim=16)
    start = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(5))
    transitions, states = transitions.to(DEVICE, dtype), states.to(DEVICE, dtype)  # stored lower, read as stored
    out = compose_affine(start.to(DEVICE), transitions, states)
    expected = naive_compose(start, transitions.cpu(), states.cpu())
    assert out.dtype == torch.float32 and out.shape == (2, 16, 16)
    assert relative_error(out, expected) <= TOLERANCE


def test_compose_equals_the_delta_rule_over_the_concatenated_chunks() -> None:
    """Composing chunk maps from a start state gives the state after running all their tokens from it."""
    transitions, states, (q, k, v, g, b) = chunk_maps(4, heads=2, key_dim=16, value_dim=24, seed=1)
    start = torch.randn(1, 2, 16, 24, generator=torch.Generator().manual_seed(6))
    joined = [x.transpose(0, 1).reshape(1, 2, -1, *x.shape[3:]) for x in (q, k, v, g, b)]
    _, expected = naive_recurrent_gated_delta_rule(*joined, start)
    out = compose_affine(start[0].to(DEVICE), transitions.to(DEVICE), states.to(DEVICE))
    assert relative_error(out, expected[0]) <= 1e-4  # two float32 paths of 48 steps


@pytest.mark.parametrize("key_dim, value_dim", [(16, 24), (12, 40), (32, 16)])
def test_compose_batched_with_steps_masks_odd_shapes(key_dim: int, value_dim: int) -> None:
    """Several requests, one with no maps, K and V not powers of two, and every intermediate state (the scan)."""
    counts = [2, 0, 5, 1]
    transitions, states, _ = chunk_maps(sum(counts), heads=3, key_dim=key_dim, value_dim=value_dim, seed=2)
    start = torch.randn(len(counts), 3, key_dim, value_dim, generator=torch.Generator().manual_seed(7))
    out, steps = compose_affine_batched(
        start.to(DEVICE), transitions.to(DEVICE), states.to(DEVICE), counts, store_steps=True
    )
    expected, expected_steps = naive_compose(start, transitions, states, counts, store_steps=True)
    assert relative_error(out, expected) <= TOLERANCE
    assert relative_error(steps, expected_steps) <= TOLERANCE
    torch.testing.assert_close(out[1].cpu(), start[1])  # no maps: the start state itself


def test_compose_strided_start_zero_start_and_addition() -> None:
    transitions, states, _ = chunk_maps(5, heads=2, key_dim=16, value_dim=16, seed=3)
    wide = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(8))
    strided = wide[..., ::2]  # a non-contiguous start state
    out = compose_affine(strided.to(DEVICE), transitions.to(DEVICE), states.to(DEVICE))
    assert relative_error(out, naive_compose(strided, transitions, states)) <= TOLERANCE
    out = compose_affine(None, transitions.to(DEVICE), states.to(DEVICE))
    assert relative_error(out, naive_compose(None, transitions, states)) <= TOLERANCE
    out = compose_affine(strided.to(DEVICE), None, states.to(DEVICE))  # `addition`: S + Z_1 + ... + Z_k
    assert relative_error(out, strided + states.sum(0)) <= TOLERANCE


def test_compose_rejects_mismatched_inputs() -> None:
    transitions, states, _ = chunk_maps(3, heads=2, key_dim=16, value_dim=16)
    with pytest.raises(ValueError, match="sum to the 3 maps"):
        compose_affine_batched(None, transitions.to(DEVICE), states.to(DEVICE), [1, 1])
    with pytest.raises(ValueError, match="do not match"):
        compose_affine_batched(None, transitions[:, :, :8].to(DEVICE), states.to(DEVICE), [3])
