"""The composition and RoPE dispatches (`ops/compose`, `ops/rope`) on their torch paths against the naive references
beside them, for every transition kind, and the backend switch they share (`ops/backends.py`). The Triton paths are
held to the same references in tests/kernels."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.compose import compose_batched, compose_in_order, naive_compose, select_backend
from hypic_rag.runtime.ops.rope import apply_rotary, naive_rope_into, rotate_into
from hypic_rag.runtime.segment_state import transition_shape

STATE_SHAPES = {"matrix": (3, 8, 5), "scalar": (3, 8, 5), "vector": (6, 4)}
"""[H, K, V] for the delta rules and the scalar decays, [D, N] for Mamba1's elementwise decay."""


def random_maps(kind: str, maps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`maps` random (P, Z) of `kind`, contracting (|P| < 1) so long folds stay O(1)."""
    generator = torch.Generator().manual_seed(seed)
    state_shape = STATE_SHAPES[kind]
    shape = transition_shape(kind, state_shape)
    transitions = torch.rand(maps, *shape, generator=generator) * (0.9 / shape[-1] if kind == "matrix" else 0.9)
    return transitions, torch.randn(maps, *state_shape, generator=generator)


@pytest.mark.parametrize("kind", sorted(STATE_SHAPES))
def test_compose_in_order_torch_equals_naive(kind: str) -> None:
    transitions, states = random_maps(kind, 5)
    start = torch.randn(STATE_SHAPES[kind], generator=torch.Generator().manual_seed(1))
    expected = naive_compose(start, transitions, states, kind=kind)
    for given in ((transitions, states), (list(transitions), list(states))):  # stacked or a list of maps
        torch.testing.assert_close(compose_in_order(start, *given, kind, backend="torch"), expected, atol=1e-5, rtol=1e-5)
    addition = compose_in_order(start, None, states, kind, backend="torch")
    torch.testing.assert_close(addition, start + states.sum(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(STATE_SHAPES))
def test_compose_batched_torch_equals_naive(kind: str) -> None:
    counts = [2, 0, 3, 1]
    transitions, states = random_maps(kind, sum(counts), seed=2)
    start = torch.randn(len(counts), *STATE_SHAPES[kind], generator=torch.Generator().manual_seed(3))
    expected, expected_steps = naive_compose(start, transitions, states, counts, kind=kind, store_steps=True)
    out = compose_batched(start, transitions, states, counts, kind, backend="torch")
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], start[1])  # no maps: the start itself
    out, steps = compose_batched(start, transitions, states, counts, kind, store_steps=True, backend="torch")
    torch.testing.assert_close(steps, expected_steps, atol=1e-5, rtol=1e-5)
    zero_start = compose_batched(None, transitions, states, counts, kind, backend="torch")
    torch.testing.assert_close(zero_start, naive_compose(None, transitions, states, counts, kind=kind))


def test_naive_compose_is_the_fold_over_spans() -> None:
    """The reference itself: P_2 (P_1 S + Z_1) + Z_2 written out for matrix maps."""
    transitions, states = random_maps("matrix", 2, seed=4)
    start = torch.randn(STATE_SHAPES["matrix"], generator=torch.Generator().manual_seed(5))
    by_hand = transitions[1] @ (transitions[0] @ start + states[0]) + states[1]
    torch.testing.assert_close(naive_compose(start, transitions, states), by_hand)


def test_rotate_into_torch_equals_naive_and_writes_only_its_rows() -> None:
    generator = torch.Generator().manual_seed(6)
    positions, rotary, heads, length, dim = 40, 8, 2, 7, 12
    angles = torch.rand(positions, rotary // 2, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    keys = torch.randn(heads, length, dim, generator=generator)
    buffer = torch.full((heads, 20, dim), 3.0)
    rotate_into(buffer, 9, keys, cos, sin, 25, backend="torch")
    expected = naive_rope_into(torch.full((heads, 20, dim), 3.0), 9, keys, cos, sin, 25)
    torch.testing.assert_close(buffer, expected)
    assert bool((buffer[:, :9] == 3).all()) and bool((buffer[:, 16:] == 3).all())
    torch.testing.assert_close(buffer[:, 9:16, rotary:], keys[..., rotary:])  # partial rotary: the rest passes
    # half-split rotation: the first pair of dims turns by the angle of position 25
    angle = angles[25:32, 0]
    first, second = keys[..., 0], keys[..., rotary // 2]
    torch.testing.assert_close(buffer[:, 9:16, 0], first * angle.cos() - second * angle.sin())
    torch.testing.assert_close(apply_rotary(keys, cos[25:32], sin[25:32]), buffer[:, 9:16])


def test_backend_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(3, 4, 4)
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "auto")
    assert backends.resolve(None, cpu) == "torch" and select_backend(cpu, "matrix") == "torch"
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "triton")
    assert backends.resolve(None, cpu) == "triton" and select_backend(cpu, "matrix") == "triton"
    assert backends.resolve("torch", cpu) == "torch"  # an explicit backend wins over the switch
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        backends.resolve("cuda", cpu)


def test_conv_tail_stitch_torch_equals_naive() -> None:
    from hypic_rag.runtime.ops.conv_tail import advance_tail_cached, naive_stitch_conv_tails, stitch_conv_tails

    generator = torch.Generator().manual_seed(7)
    counts, channels, width = [3, 0, 4], 5, 3
    tails = torch.randn(sum(counts), channels, width, generator=generator)
    lengths = [0, 1, 5, 2, 3, 1, 0]
    start = torch.randn(len(counts), channels, width, generator=generator)
    expected, expected_steps = naive_stitch_conv_tails(start, tails, lengths, counts, store_steps=True)
    out, steps = stitch_conv_tails(start, tails, lengths, counts, store_steps=True, backend="torch")
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(steps, expected_steps, atol=0, rtol=0)
    # one step by hand: a span of 1 token shifts the tail left by one and appends its input
    step = advance_tail_cached(start[0], tails[1], 1)
    torch.testing.assert_close(step, torch.cat([start[0][:, 1:], tails[1][:, -1:]], dim=1))
