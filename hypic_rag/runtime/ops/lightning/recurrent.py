"""Step-by-step scalar-decay linear attention for a handful of tokens (decode). Same contract as `naive.py`."""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.step_rows import head_rows, joined_outputs, start_rows


def fused_recurrent_lightning(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay broadcastable to [B, H, T];
    initial_state [B, H, K, V] or None.

    Returns output [B, H, T, V] and the final state [B, H, K, V], float32 (the input state is not modified).
    """
    state = start_rows(key, value, initial_state)
    query_rows, key_rows, value_rows = head_rows(query, key, value)
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(*key.shape[:3]).flatten(0, 1).exp()
    outputs = []
    for t in range(key.shape[2]):
        state.mul_(decay[:, t, None, None])
        state.baddbmm_(key_rows[:, t : t + 1].transpose(1, 2), value_rows[:, t : t + 1])
        outputs.append(torch.bmm(query_rows[:, t : t + 1], state))
    return joined_outputs(outputs, state, key, value)
