"""The state of a recurrent mixer over a span is affine in its start: S_end = P S_0 + Z.

`SegmentState` holds (P, Z) for one span (any leading batch/head dims) and the KIND of its transition P, which
is all that differs between the mixer families (docs/runtime.md, "Mixers"):
- "matrix": P [..., K, K] acting on Z [..., K, V] from the left (delta rules: Gated DeltaNet, KDA, Ling):
  apply = P @ S + Z;
- "vector": a diagonal / elementwise decay, P with Z's number of dims and broadcastable to it ([..., K, 1] for
  a per-key-channel gate, or Z's own shape for Mamba1's elementwise decay): apply = P * S + Z;
- "scalar": one decay per head, P [..., 1, 1] (SSD / Mamba2, lightning attention): apply = P * S + Z.
Span X then span Y compose as P_XY = P_Y . P_X, Z_XY = P_Y . Z_X + Z_Y (associative), "." being the kind's
product. Everything is float32 while composing. These torch ops are the CPU path and the reference; on CUDA the
runtime composes a run of maps of any kind in one Triton launch (`runtime/ops/compose`, its dispatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from hypic_rag.runtime.threads import wide_for

TransitionKind = Literal["matrix", "vector", "scalar"]
TRANSITION_KINDS: tuple[str, ...] = ("matrix", "vector", "scalar")


def transition_shape(kind: str, state_shape: Sequence[int], vector_shape: Sequence[int] | None = None) -> tuple[int, ...]:
    """The shape of P for a state of `state_shape` [..., K, V]: [..., K, K] (matrix), [..., 1, 1] (scalar) or
    `vector_shape` (vector: Z's number of dims, broadcastable to it; default Z's own shape)."""
    state_shape = tuple(state_shape)
    if kind == "matrix":
        return (*state_shape[:-1], state_shape[-2])
    if kind == "scalar":
        return (*state_shape[:-2], 1, 1)
    if kind == "vector":
        return tuple(vector_shape) if vector_shape is not None else state_shape
    raise ValueError(f"unknown transition kind {kind!r}; expected one of {', '.join(TRANSITION_KINDS)}")


@dataclass(slots=True)
class SegmentState:
    """Affine map of one span: `apply(S_0) = P S_0 + Z` with P of `kind` (see the module docstring).

    transition P: [..., K, K] (matrix), broadcastable to Z with Z's dims (vector), [..., 1, 1] (scalar);
    state Z: [..., K, V] (any trailing state shape of at least two dims).
    """

    transition: torch.Tensor
    state: torch.Tensor
    kind: str = "matrix"

    def __post_init__(self) -> None:
        shape, state_shape = tuple(self.transition.shape), tuple(self.state.shape)
        if self.kind == "matrix":
            expected = transition_shape("matrix", state_shape)
            if shape != expected:
                raise ValueError(
                    f"transition must have shape {expected} for a state of shape {state_shape}, got {shape}"
                )
        elif self.kind == "scalar":
            expected = transition_shape("scalar", state_shape)
            if shape != expected:
                raise ValueError(f"a scalar transition must have shape {expected} for a state of shape {state_shape}, got {shape}")
        elif self.kind == "vector":
            broadcastable = len(shape) == len(state_shape) and all(p in (1, s) for p, s in zip(shape, state_shape))
            if not broadcastable:
                raise ValueError(
                    f"a vector transition must have the state's {len(state_shape)} dims and broadcast to "
                    f"{state_shape}, got {shape}"
                )
        else:
            raise ValueError(f"unknown transition kind {self.kind!r}; expected one of {', '.join(TRANSITION_KINDS)}")

    @classmethod
    def identity(
        cls, state_like: torch.Tensor, kind: str = "matrix", vector_shape: Sequence[int] | None = None
    ) -> SegmentState:
        """The empty span: P = identity of `kind`, Z = 0, for states shaped like `state_like` [..., K, V]."""
        options = dict(dtype=torch.float32, device=state_like.device)
        shape = transition_shape(kind, state_like.shape, vector_shape)
        if kind == "matrix":
            key_dim = state_like.shape[-2]
            transition = torch.eye(key_dim, **options).expand(shape).clone()
        else:
            transition = torch.ones(shape, **options)
        return cls(transition, torch.zeros(state_like.shape, **options), kind)

    def select(self, index: int | slice) -> SegmentState:
        """The maps at `index` of the first leading dim (e.g. one run of a batched `TransitionRun`)."""
        return SegmentState(self.transition[index], self.state[index], self.kind)

    def _act(self, operand: torch.Tensor) -> torch.Tensor:
        """P . operand (float32): a matrix product for "matrix", an elementwise product otherwise."""
        transition = self.transition.float()
        return transition @ operand.float() if self.kind == "matrix" else transition * operand.float()

    def apply(self, start: torch.Tensor) -> torch.Tensor:
        """End state [..., K, V] of the span started from `start` [..., K, V] (float32)."""
        return self._act(start) + self.state.float()

    def then(self, later: SegmentState) -> SegmentState:
        """This span followed by `later` (of the same kind): (P_later . P_self, P_later . Z_self + Z_later)."""
        if later.kind != self.kind:
            raise ValueError(f"cannot compose a {self.kind} transition with a {later.kind} one")
        return SegmentState(later._act(self.transition), later.apply(self.state), self.kind)


def apply_in_order(
    start: torch.Tensor, transitions: Sequence[torch.Tensor] | None, states: Sequence[torch.Tensor], kind: str
) -> torch.Tensor:
    """S <- P_k . (... (P_1 . S + Z_1) ...) + Z_k over spans in order (float32); `transitions=None` is the
    `addition` baseline (P = identity: S + Z_1 + ... + Z_k)."""
    state = start if start.dtype == torch.float32 else start.float()
    if (
        transitions is not None and kind == "matrix" and state.dim() >= 2
        and all(t.shape == state.shape[:-1] + state.shape[-2:-1] and z.shape == state.shape for t, z in zip(transitions, states))
    ):
        # the hot path of composition: S <- Z + P S as one fused batched product per span (no SegmentState checks)
        shape = state.shape
        flat = state if state.dim() == 3 else state.reshape(-1, *shape[-2:])
        with wide_for(flat.shape[0] * shape[-2] * shape[-2] * shape[-1]):  # large states: every thread
            for transition, suffix_state in zip(transitions, states):
                # entries hold float32 [H, K, K] / [H, K, V] already: no conversion or reshape to dispatch then
                if transition.dtype != torch.float32 or transition.dim() != 3:
                    transition = transition.float().reshape(-1, *transition.shape[-2:])
                if suffix_state.dtype != torch.float32 or suffix_state.dim() != 3:
                    suffix_state = suffix_state.float().reshape(flat.shape)
                flat = torch.baddbmm(suffix_state, transition, flat)
        return flat if state.dim() == 3 else flat.reshape(shape)
    for number, suffix_state in enumerate(states):
        if transitions is None:
            state = state + suffix_state.float()
        else:
            state = SegmentState(transitions[number], suffix_state, kind).apply(state)
    return state
