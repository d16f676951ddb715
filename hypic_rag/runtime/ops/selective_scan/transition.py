"""The affine map of a span for Mamba1: S_end = P * S_0 + Z with P ELEMENTWISE, the shape of the state [D, N].

Each state entry decays at its own rate, so P[d, n] = exp(a[d, n] * sum_t dt_t[d]) and the span's map is a
Hadamard product plus Z (the end state from S_0 = 0). The outputs split the same way:
    y_t[d](S_0) = y_t[d](0) + sum_n exp(a[d, n] Delta_t[d]) c_t[n] S_0[d, n],   Delta_t = sum_{s <= t} dt_s,
which `selective_scan_start_output` evaluates from the span's cumulative dt without rerunning it (the per-token
weights would be [D, T, N], 130 MB per layer for Jamba-v0.1 at T = 256, so they are not materialised).
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.registry import call
from hypic_rag.runtime.ops.selective_scan.scan import DEFAULT_BLOCK_SIZE

START_OUTPUT_BLOCK = 64
"""Tokens per block in `selective_scan_start_output`, bounding its temporary to [rows, D, 64, N]."""
START_OUTPUT_ELEMENTS = 1 << 20
"""At most about this many elements in `selective_scan_start_output`'s temporary (fewer rows of the batch at once
when it would be larger): a batch of many runs stays as fast per run as a few (memory traffic, not arithmetic)."""


def selective_scan_with_transition(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run a span from S_0 = 0 and return its outputs and affine map.

    Args:
        x, dt [batch, D, T]; a [D, N]; b, c [batch, T, N]; d [D] or None.
    Returns:
        output_zero_start [batch, D, T]: outputs from S_0 = 0 (including the d x skip);
        cumulative_dt [batch, D, T]: Delta_t, for `selective_scan_start_output` (outputs from any S_0);
        transition P [batch, D, N]: exp(a * sum_t dt_t), so S_end = P * S_0 + Z;
        state Z [batch, D, N]: the end state from S_0 = 0. All float32.
    """
    output, state = call("selective_scan", x=x, dt=dt, a=a, b=b, c=c, d=d, initial_state=None, block_size=block_size)
    cumulative_dt = dt.float().cumsum(-1)
    total = cumulative_dt[..., -1] if dt.shape[-1] else cumulative_dt.new_zeros(dt.shape[:2])
    transition = torch.exp(total[..., None] * a.float())
    return output, cumulative_dt, transition, state


def selective_scan_start_output(
    cumulative_dt: torch.Tensor, a: torch.Tensor, c: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """What a start state adds to a span's outputs: sum_n exp(a[d, n] Delta_t[d]) c_t[n] S_0[d, n].

    Args:
        cumulative_dt [batch, D, T] (from `selective_scan_with_transition`); a [D, N]; c [batch, T, N];
        start S_0 [batch, D, N].
    Returns:
        [batch, D, T] float32; the span's outputs from S_0 are output_zero_start + this.
    """
    a, c, start = a.float(), c.float(), start.float()
    batch, channels, length = cumulative_dt.shape
    result = torch.empty(cumulative_dt.shape, dtype=torch.float32, device=cumulative_dt.device)
    block = min(START_OUTPUT_BLOCK, max(length, 1))
    rows = max(1, START_OUTPUT_ELEMENTS // (channels * block * a.shape[1]))
    for first in range(0, batch, rows):
        last = first + rows
        for begin in range(0, length, block):
            end = begin + block
            decay = torch.exp(cumulative_dt[first:last, :, begin:end, None].float() * a[:, None, :])  # [rows, D, block, N]
            result[first:last, :, begin:end] = (
                (decay * start[first:last, :, None, :]) * c[first:last, None, begin:end]
            ).sum(-1)
    return result


def apply_selective_scan_transition(
    transition: torch.Tensor, state: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """End state P * S_0 + Z of a span; all three [..., D, N] (float32)."""
    return transition.float() * start.float() + state.float()


def compose_selective_scan_transitions(
    first: tuple[torch.Tensor, torch.Tensor], later: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Span X then span Y as (P, Z) pairs: (P_Y * P_X, P_Y * Z_X + Z_Y)."""
    (first_transition, first_state), (later_transition, later_state) = first, later
    return later_transition * first_transition, apply_selective_scan_transition(later_transition, later_state, first_state)
