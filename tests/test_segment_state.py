"""Composition of affine span maps: fold and tree agree with applying spans one after another, for every kind."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.segment_state import SegmentState, TransitionKind, compose_fold, compose_tree, prefix_scan

SHAPES = {
    TransitionKind.MATRIX: lambda h, k, v: (h, k, k),
    TransitionKind.DIAGONAL: lambda h, k, v: (h, k),
    TransitionKind.SCALAR: lambda h, k, v: (h,),
    TransitionKind.ELEMENTWISE: lambda h, k, v: (h, k, v),
}


def random_spans(kind: TransitionKind, count: int, seed: int, heads: int = 3, key_dim: int = 6, value_dim: int = 5):
    generator = torch.Generator().manual_seed(seed)
    spans = []
    for _ in range(count):
        transition = torch.randn(*SHAPES[kind](heads, key_dim, value_dim), generator=generator) * 0.5
        state = torch.randn(heads, key_dim, value_dim, generator=generator)
        spans.append(SegmentState(transition, state, kind))
    return spans


@pytest.mark.parametrize("kind", list(TransitionKind))
@pytest.mark.parametrize("count", [1, 2, 5, 8])
def test_fold_and_tree_equal_sequential_application(kind: TransitionKind, count: int) -> None:
    spans = random_spans(kind, count, seed=count)
    start = torch.randn(3, 6, 5)
    sequential = prefix_scan(start, spans)[-1]
    folded, tree = compose_fold(spans), compose_tree(spans)
    torch.testing.assert_close(folded.apply(start), sequential, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree.apply(start), sequential, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree.transition, folded.transition, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tree.state, folded.state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(TransitionKind))
def test_identity_is_neutral(kind: TransitionKind) -> None:
    span = random_spans(kind, 1, seed=2)[0]
    identity = SegmentState.identity(span.state, kind)
    start = torch.randn(3, 6, 5)
    torch.testing.assert_close(identity.then(span).apply(start), span.apply(start))
    torch.testing.assert_close(span.then(identity).apply(start), span.apply(start))


def test_shape_and_kind_errors() -> None:
    with pytest.raises(ValueError, match="matrix transition must have shape"):
        SegmentState(torch.zeros(3, 6), torch.zeros(3, 6, 5), TransitionKind.MATRIX)
    matrix = random_spans(TransitionKind.MATRIX, 1, seed=0)[0]
    diagonal = random_spans(TransitionKind.DIAGONAL, 1, seed=0)[0]
    with pytest.raises(ValueError, match="cannot compose"):
        matrix.then(diagonal)
    with pytest.raises(ValueError):
        compose_tree([])
