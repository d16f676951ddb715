"""Step-by-step SSD for a handful of tokens (decode): no chunk padding, no C x C score matrices.

Same contract and mathematics as `naive.naive_ssd` (the reference), written for speed at T of 1-4: the state is
updated in place with batched products. Longer inputs belong to `chunk.py`.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.ssd.naive import check_ssd_shapes, expand_groups


def recurrent_ssd(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [batch, H, T, P]; dt [batch, H, T]; a [H]; b, c [batch, G, T, N]; d [H] or None;
    initial_state [batch, H, N, P] or None. Returns output [batch, H, T, P] and the final state [batch, H, N, P],
    float32 (the input state is not modified).
    """
    check_ssd_shapes(x, dt, a, b, c)
    batch, heads, length, head_dim = x.shape
    state_size = b.shape[-1]
    rows = batch * heads
    if initial_state is None:
        state = torch.zeros(rows, state_size, head_dim, dtype=torch.float32, device=x.device)
    else:
        state = initial_state.float().reshape(rows, state_size, head_dim).clone()
    x_rows = x.float().reshape(rows, length, head_dim)
    b_rows = expand_groups(b.float(), heads).reshape(rows, length, state_size)
    c_rows = expand_groups(c.float(), heads).reshape(rows, length, state_size)
    dt_rows = dt.float().reshape(rows, length)
    decay = torch.exp(dt_rows * a.float().repeat(batch)[:, None])  # [rows, T]
    outputs = []
    for t in range(length):
        state.mul_(decay[:, t, None, None])
        state.baddbmm_((b_rows[:, t] * dt_rows[:, t, None])[:, :, None], x_rows[:, t : t + 1])
        outputs.append(torch.bmm(c_rows[:, t : t + 1], state))  # [rows, 1, P]
    output = torch.cat(outputs, dim=1) if outputs else x_rows.new_zeros(rows, 0, head_dim)
    output = output.reshape(batch, heads, length, head_dim)
    if d is not None:
        output = output + d.float()[None, :, None, None] * x.float()
    return output, state.reshape(batch, heads, state_size, head_dim)
