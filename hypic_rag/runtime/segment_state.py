"""The state of a linear-attention layer over a span is affine in its start: S_end = P S_0 + Z.

`SegmentState` holds (P, Z) for one span (any leading batch/layer/head dims). Composition of span X then span Y is
    P_XY = P_Y P_X,   Z_XY = P_Y Z_X + Z_Y
which is associative, so a list of spans reduces by a left fold or by a log-depth tree with the same result.

The transition P takes the shape its mixer needs, so every family fits one type:
- MATRIX      [..., K, K]   Gated DeltaNet, KDA: a_t (I - b_t k_t k_t^T) [Diag(a_t)]
- DIAGONAL    [..., K]      GLA: a per-key-channel decay
- SCALAR      [...]         Mamba2, Lightning, SimpleGLA: one decay per head
- ELEMENTWISE [..., K, V]   Mamba1: a decay per state entry
Z is always [..., K, V]. Keep both in float32 while composing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch


class TransitionKind(str, Enum):
    MATRIX = "matrix"
    DIAGONAL = "diagonal"
    SCALAR = "scalar"
    ELEMENTWISE = "elementwise"


def _apply_transition(kind: TransitionKind, transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """P applied to a state [..., K, V]."""
    if kind is TransitionKind.MATRIX:
        return transition @ state
    if kind is TransitionKind.DIAGONAL:
        return transition[..., :, None] * state
    if kind is TransitionKind.SCALAR:
        return transition[..., None, None] * state
    return transition * state


def _compose_transitions(kind: TransitionKind, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """P_second P_first."""
    if kind is TransitionKind.MATRIX:
        return second @ first
    return second * first


@dataclass(slots=True)
class SegmentState:
    """Affine map of one span: `apply(S_0) = P S_0 + Z`.

    transition: P, shape by `kind` (see module docstring); state: Z [..., K, V].
    """

    transition: torch.Tensor
    state: torch.Tensor
    kind: TransitionKind = TransitionKind.MATRIX

    def __post_init__(self) -> None:
        self.kind = TransitionKind(self.kind)
        lead, key_dim, value_dim = self.state.shape[:-2], self.state.shape[-2], self.state.shape[-1]
        expected = {
            TransitionKind.MATRIX: (*lead, key_dim, key_dim),
            TransitionKind.DIAGONAL: (*lead, key_dim),
            TransitionKind.SCALAR: tuple(lead),
            TransitionKind.ELEMENTWISE: (*lead, key_dim, value_dim),
        }[self.kind]
        if tuple(self.transition.shape) != tuple(expected):
            raise ValueError(
                f"{self.kind.value} transition must have shape {tuple(expected)} for a state of shape "
                f"{tuple(self.state.shape)}, got {tuple(self.transition.shape)}"
            )

    @classmethod
    def identity(cls, state_like: torch.Tensor, kind: TransitionKind = TransitionKind.MATRIX) -> SegmentState:
        """The empty span: P = I, Z = 0, for states shaped like `state_like` [..., K, V]."""
        lead, key_dim = state_like.shape[:-2], state_like.shape[-2]
        options = dict(dtype=torch.float32, device=state_like.device)
        kind = TransitionKind(kind)
        if kind is TransitionKind.MATRIX:
            transition = torch.eye(key_dim, **options).expand(*lead, key_dim, key_dim).clone()
        elif kind is TransitionKind.DIAGONAL:
            transition = torch.ones(*lead, key_dim, **options)
        elif kind is TransitionKind.SCALAR:
            transition = torch.ones(*lead, **options)
        else:
            transition = torch.ones(state_like.shape, **options)
        return cls(transition, torch.zeros(state_like.shape, **options), kind)

    def apply(self, start: torch.Tensor) -> torch.Tensor:
        """End state [..., K, V] of the span started from `start` [..., K, V]."""
        return _apply_transition(self.kind, self.transition, start) + self.state

    def then(self, later: SegmentState) -> SegmentState:
        """This span followed by `later`: (P_later P_self, P_later Z_self + Z_later)."""
        if later.kind is not self.kind:
            raise ValueError(f"cannot compose a {self.kind.value} span with a {later.kind.value} span")
        return SegmentState(
            transition=_compose_transitions(self.kind, self.transition, later.transition),
            state=_apply_transition(self.kind, later.transition, self.state) + later.state,
            kind=self.kind,
        )


def compose_fold(spans: Sequence[SegmentState]) -> SegmentState:
    """Left fold: ((s0 then s1) then s2) ... ; len(spans) - 1 compositions in sequence."""
    if not spans:
        raise ValueError("compose_fold needs at least one span")
    result = spans[0]
    for span in spans[1:]:
        result = result.then(span)
    return result


def compose_tree(spans: Sequence[SegmentState]) -> SegmentState:
    """Log-depth pairwise reduction; equal to `compose_fold` up to float round-off.

    Each level composes neighbours (2i, 2i+1) in one batched call, so depth is ceil(log2(n)).
    """
    if not spans:
        raise ValueError("compose_tree needs at least one span")
    level = list(spans)
    while len(level) > 1:
        pairs = len(level) // 2
        kind = level[0].kind
        firsts = [level[2 * i] for i in range(pairs)]
        seconds = [level[2 * i + 1] for i in range(pairs)]
        first_p = torch.stack([s.transition for s in firsts])
        first_z = torch.stack([s.state for s in firsts])
        second_p = torch.stack([s.transition for s in seconds])
        second_z = torch.stack([s.state for s in seconds])
        merged = SegmentState(first_p, first_z, kind).then(SegmentState(second_p, second_z, kind))
        next_level = [SegmentState(merged.transition[i], merged.state[i], kind) for i in range(pairs)]
        if len(level) % 2:
            next_level.append(level[-1])
        level = next_level
    return level[0]


def prefix_scan(start: torch.Tensor, spans: Sequence[SegmentState]) -> list[torch.Tensor]:
    """States entering each span when the first span starts at `start` [..., K, V]: [start, s0(start), ...].

    Returns len(spans) + 1 states; the last is the end state.
    """
    states = [start]
    for span in spans:
        states.append(span.apply(states[-1]))
    return states
