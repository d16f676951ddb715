"""Step-by-step gated delta rule for a handful of tokens (decode): no chunk padding, no triangular solves.

Same contract and mathematics as `naive.recurrent` (the reference), written for speed at T of 1-4: the state is
updated in place with batched matrix products. Longer inputs belong to `chunk.py`.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.step_rows import head_rows, joined_outputs, start_rows


def fused_recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay, beta [B, H, T]; initial_state [B, H, K, V] or None.

    Returns output [B, H, T, V] and the final state [B, H, K, V], float32 (the input state is not modified).
    """
    state = start_rows(key, value, initial_state)
    query_rows, key_rows, value_rows = head_rows(query, key, value)
    decay = log_decay.float().flatten(0, 1).exp()  # [B*H, T]
    strength = beta.float().flatten(0, 1)
    outputs = []
    for t in range(key.shape[2]):
        k_t = key_rows[:, t : t + 1]  # [BH, 1, K]
        state.mul_(decay[:, t, None, None])
        error = value_rows[:, t : t + 1] - torch.bmm(k_t, state)  # [BH, 1, V]
        state.baddbmm_(k_t.transpose(1, 2), error * strength[:, t, None, None])
        outputs.append(torch.bmm(query_rows[:, t : t + 1], state))
    return joined_outputs(outputs, state, key, value)
