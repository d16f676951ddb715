"""Composition of affine span maps: `then` is associative and equals applying spans one after another."""

from __future__ import annotations

import functools

import pytest
import torch

from hypic_rag.runtime.segment_state import SegmentState


def random_spans(count: int, seed: int, heads: int = 3, key_dim: int = 6, value_dim: int = 5) -> list[SegmentState]:
    generator = torch.Generator().manual_seed(seed)
    return [
        SegmentState(torch.randn(heads, key_dim, key_dim, generator=generator) * 0.5,
                     torch.randn(heads, key_dim, value_dim, generator=generator))
        for _ in range(count)
    ]


@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_composition_equals_sequential_application(count: int) -> None:
    spans = random_spans(count, seed=count)
    start = torch.randn(3, 6, 5)
    sequential = start
    for span in spans:
        sequential = span.apply(sequential)
    left = functools.reduce(SegmentState.then, spans)
    torch.testing.assert_close(left.apply(start), sequential, atol=1e-5, rtol=1e-5)
    if count >= 3:  # associativity: (a b) c == a (b c)
        right = spans[0].then(functools.reduce(SegmentState.then, spans[1:]))
        torch.testing.assert_close(right.transition, left.transition, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(right.state, left.state, atol=1e-5, rtol=1e-5)


def test_identity_is_neutral() -> None:
    span = random_spans(1, seed=2)[0]
    identity = SegmentState.identity(span.state)
    start = torch.randn(3, 6, 5)
    torch.testing.assert_close(identity.then(span).apply(start), span.apply(start))
    torch.testing.assert_close(span.then(identity).apply(start), span.apply(start))


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="transition must have shape"):
        SegmentState(torch.zeros(3, 6), torch.zeros(3, 6, 5))
