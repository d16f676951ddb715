"""Step-by-step scalar-decay linear attention for a handful of tokens (decode). Same contract as `naive.py`."""

from __future__ import annotations

import torch


def fused_recurrent_lightning(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay broadcastable to [B, H, T];
    initial_state [B, H, K, V] or None.

    Returns output [B, H, T, V] and the final state [B, H, K, V], float32 (the input state is not modified).
    """
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    if initial_state is None:
        state = torch.zeros(batch * heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    else:
        state = initial_state.float().reshape(batch * heads, key_dim, value_dim).clone()
    query_rows, key_rows, value_rows = (
        x.float().reshape(batch * heads, length, x.shape[-1]) for x in (query, key, value)
    )
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(batch, heads, length)
    decay = decay.reshape(batch * heads, length).exp()
    outputs = []
    for t in range(length):
        state.mul_(decay[:, t, None, None])
        state.baddbmm_(key_rows[:, t : t + 1].transpose(1, 2), value_rows[:, t : t + 1])
        outputs.append(torch.bmm(query_rows[:, t : t + 1], state))
    output = torch.cat(outputs, dim=1) if outputs else value_rows.new_zeros(batch * heads, 0, value_dim)
    return output.reshape(batch, heads, length, value_dim), state.reshape(batch, heads, key_dim, value_dim)
