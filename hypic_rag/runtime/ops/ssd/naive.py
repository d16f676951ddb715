"""Token-by-token float32 reference of the Mamba2 / SSD recurrence. Slow; the ground truth for tests."""

from __future__ import annotations

import torch


def expand_groups(grouped: torch.Tensor, heads: int) -> torch.Tensor:
    """[batch, G, T, N] -> [batch, H, T, N]: head h reads group h // (H / G), as Mamba2 repeats B and C."""
    groups = grouped.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} heads cannot share {groups} groups of B/C evenly")
    return grouped.repeat_interleave(heads // groups, dim=1)


def check_ssd_shapes(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Raise ValueError unless x [batch, H, T, P], dt [batch, H, T], a [H], b and c [batch, G, T, N] with G | H."""
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, H, T, P], got {tuple(x.shape)}")
    batch, heads, length, _ = x.shape
    if tuple(dt.shape) != (batch, heads, length) or tuple(a.shape) != (heads,):
        raise ValueError(f"dt {tuple(dt.shape)} / a {tuple(a.shape)} do not match x {tuple(x.shape)}")
    if b.dim() != 4 or b.shape != c.shape or b.shape[0] != batch or b.shape[2] != length or heads % b.shape[1]:
        raise ValueError(f"b {tuple(b.shape)} and c {tuple(c.shape)} must be [batch, G, T, N] with G dividing {heads}")


def naive_ssd(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the SSD recurrence one token at a time in float32.

    Per head h (head dim P, state size N), with group g(h) supplying b and c:
        S_t = exp(dt_t a_h) S_{t-1} + dt_t b_t x_t^T      (state [N, P])
        y_t = S_t^T c_t + d_h x_t

    Args:
        x: [batch, H, T, P], the SSM input (Mamba's x after the conv and activation).
        dt: [batch, H, T], the discretised time step (softplus(raw + bias), clamped), >= 0.
        a: [H], the continuous decay rate (Mamba's A = -exp(A_log)), < 0.
        b, c: [batch, G, T, N] with G dividing H (Mamba's B and C).
        d: [H] skip weight (Mamba's D) or None.
        initial_state: [batch, H, N, P] or None (zeros). transformers stores [batch, H, P, N]: transpose(-1, -2).
    Returns:
        output y [batch, H, T, P] and final state [batch, H, N, P], both float32.
    """
    check_ssd_shapes(x, dt, a, b, c)
    x, dt, a = x.float(), dt.float(), a.float()
    batch, heads, length, head_dim = x.shape
    b, c = expand_groups(b.float(), heads), expand_groups(c.float(), heads)
    state_size = b.shape[-1]
    state = (
        torch.zeros(batch, heads, state_size, head_dim, dtype=torch.float32, device=x.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    output = torch.empty(batch, heads, length, head_dim, dtype=torch.float32, device=x.device)
    for t in range(length):
        decay = torch.exp(dt[:, :, t] * a)  # [batch, H]
        update = (dt[:, :, t, None] * b[:, :, t])[..., :, None] * x[:, :, t, None, :]  # [batch, H, N, P]
        state = state * decay[..., None, None] + update
        output[:, :, t] = torch.einsum("bhnp,bhn->bhp", state, c[:, :, t])
    if d is not None:
        output = output + d.float()[None, :, None, None] * x
    return output, state
