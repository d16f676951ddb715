"""The affine map of a span for SSD: S_end = P S_0 + Z with P a SCALAR per head, P = exp(sum_t dt_t a_h).

The decay exp(dt_t a_h) multiplies the whole [N, P] state, so a span's transition is one number per head (a few
bytes per layer), Z is the span's end state from S_0 = 0, and the outputs split the same way:
    y_t(S_0) = y_t(0) + exp(Gamma_t) S_0^T c_t,   Gamma_t = sum_{s <= t} dt_s a_h,
so `output_zero_start + output_transition @ S_0` with output_transition_t = exp(Gamma_t) c_t [.., T, N] gives the
outputs for any later start state without running the span again (the same contract as the gated delta rule's).
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.registry import call
from hypic_rag.runtime.ops.ssd.chunk import DEFAULT_CHUNK_SIZE
from hypic_rag.runtime.ops.ssd.naive import expand_groups


def ssd_with_transition(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a span from S_0 = 0 and return its outputs and affine map.

    Args:
        x [batch, H, T, P]; dt [batch, H, T]; a [H]; b, c [batch, G, T, N]; d [H] or None.
    Returns:
        output_zero_start [batch, H, T, P]: outputs from S_0 = 0 (including the d x skip);
        output_transition [batch, H, T, N]: exp(Gamma_t) c_t, so outputs from S_0 add output_transition @ S_0;
        transition P [batch, H]: exp(sum_t dt_t a_h), so S_end = P[..., None, None] * S_0 + Z;
        state Z [batch, H, N, P]: the end state from S_0 = 0. All float32.
    """
    output, state = call("ssd", x=x, dt=dt, a=a, b=b, c=c, d=d, initial_state=None, chunk_size=chunk_size)
    cumulative = (dt.float() * a.float()[None, :, None]).cumsum(-1)  # Gamma_t [batch, H, T]
    output_transition = cumulative.exp()[..., None] * expand_groups(c.float(), x.shape[1])
    transition = cumulative[..., -1].exp() if x.shape[2] else torch.ones(dt.shape[:2], device=dt.device)
    return output, output_transition, transition, state


def apply_ssd_transition(transition: torch.Tensor, state: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """End state P S_0 + Z of a span: transition [..., H], state Z and start S_0 [..., H, N, P] (float32)."""
    return transition.float()[..., None, None] * start.float() + state.float()


def compose_ssd_transitions(
    first: tuple[torch.Tensor, torch.Tensor], later: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Span X then span Y as (P, Z) pairs: (P_Y P_X, P_Y Z_X + Z_Y)."""
    (first_transition, first_state), (later_transition, later_state) = first, later
    return later_transition * first_transition, apply_ssd_transition(later_transition, later_state, first_state)
