"""The state of a linear-attention layer over a span is affine in its start: S_end = P S_0 + Z.

`SegmentState` holds (P, Z) for one span (any leading batch/head dims). Span X then span Y compose as
    P_XY = P_Y P_X,   Z_XY = P_Y Z_X + Z_Y
(associative), and the runtime advances a running state over a cached span with `apply`.

Gated DeltaNet's transition is a matrix per head: P [..., K, K], Z [..., K, V], both float32 while composing.
Mixers with smaller transitions (a scalar or a vector decay) add their kind here together with their first user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SegmentState:
    """Affine map of one span: `apply(S_0) = P S_0 + Z`; transition P [..., K, K], state Z [..., K, V]."""

    transition: torch.Tensor
    state: torch.Tensor

    def __post_init__(self) -> None:
        lead, key_dim = self.state.shape[:-2], self.state.shape[-2]
        expected = (*lead, key_dim, key_dim)
        if tuple(self.transition.shape) != expected:
            raise ValueError(
                f"transition must have shape {expected} for a state of shape {tuple(self.state.shape)}, "
                f"got {tuple(self.transition.shape)}"
            )

    @classmethod
    def identity(cls, state_like: torch.Tensor) -> SegmentState:
        """The empty span: P = I, Z = 0, for states shaped like `state_like` [..., K, V]."""
        lead, key_dim = state_like.shape[:-2], state_like.shape[-2]
        options = dict(dtype=torch.float32, device=state_like.device)
        transition = torch.eye(key_dim, **options).expand(*lead, key_dim, key_dim).clone()
        return cls(transition, torch.zeros(state_like.shape, **options))

    def apply(self, start: torch.Tensor) -> torch.Tensor:
        """End state [..., K, V] of the span started from `start` [..., K, V] (float32)."""
        return self.transition.float() @ start + self.state.float()

    def then(self, later: SegmentState) -> SegmentState:
        """This span followed by `later`: (P_later P_self, P_later Z_self + Z_later)."""
        return SegmentState(later.transition @ self.transition, later.apply(self.state))
