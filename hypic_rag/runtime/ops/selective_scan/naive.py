"""Token-by-token float32 reference of Mamba1's selective scan. Slow; the ground truth for tests."""

from __future__ import annotations

import torch


def check_selective_scan_shapes(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor
) -> None:
    """Raise ValueError unless x and dt [batch, D, T], a [D, N], b and c [batch, T, N]."""
    if x.dim() != 3 or dt.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and dt {tuple(dt.shape)} must both be [batch, D, T]")
    batch, channels, length = x.shape
    if a.dim() != 2 or a.shape[0] != channels:
        raise ValueError(f"a {tuple(a.shape)} must be [D, N] with D = {channels}")
    if tuple(b.shape) != (batch, length, a.shape[1]) or b.shape != c.shape:
        expected = (batch, length, a.shape[1])
        raise ValueError(f"b {tuple(b.shape)} and c {tuple(c.shape)} must be [batch, T, N] = {expected}")


def naive_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the Mamba1 recurrence one token at a time in float32.

    Per channel d and state index n (every channel decays each state entry at its own rate):
        S_t[d, n] = exp(dt_t[d] a[d, n]) S_{t-1}[d, n] + dt_t[d] x_t[d] b_t[n]
        y_t[d]    = sum_n S_t[d, n] c_t[n] + d[d] x_t[d]

    Args:
        x: [batch, D, T], the SSM input (Mamba's x after the conv and activation), channel-major like mamba_ssm.
        dt: [batch, D, T], the discretised time step (softplus(dt_proj(...) + bias)), >= 0.
        a: [D, N], the continuous decay rates (Mamba's A = -exp(A_log)), < 0.
        b, c: [batch, T, N] (Mamba's B and C, shared by all channels).
        d: [D] skip weight (Mamba's D) or None.
        initial_state: [batch, D, N] or None (zeros); the layout of transformers' cache entry.
    Returns:
        output y [batch, D, T] (before any z gate) and final state [batch, D, N], both float32.
    """
    check_selective_scan_shapes(x, dt, a, b, c)
    x, dt, a, b, c = (t.float() for t in (x, dt, a, b, c))
    batch, channels, length = x.shape
    state = (
        torch.zeros(batch, channels, a.shape[1], dtype=torch.float32, device=x.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    output = torch.empty(batch, channels, length, dtype=torch.float32, device=x.device)
    for t in range(length):
        decay = torch.exp(dt[:, :, t, None] * a)  # [batch, D, N]
        state = decay * state + (dt[:, :, t] * x[:, :, t])[..., None] * b[:, None, t]
        output[:, :, t] = (state * c[:, None, t]).sum(-1)
    if d is not None:
        output = output + d.float()[None, :, None] * x
    return output, state
