"""Token-by-token float32 reference of the gated delta rule. Slow; the ground truth for tests."""

from __future__ import annotations

import torch


def naive_recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence one token at a time in float32.

    Args:
        query, key: [B, H, T, K] (already normalised and scaled as the model wants).
        value: [B, H, T, V].
        log_decay: [B, H, T], g_t <= 0; the state is multiplied by exp(g_t).
        beta: [B, H, T], write strength in [0, 1].
        initial_state: [B, H, K, V] or None (zeros).
    Returns:
        output [B, H, T, V] (read after the update, o_t = S_t^T q_t) and final state [B, H, K, V], both float32.
    """
    query, key, value, log_decay, beta = (x.float() for x in (query, key, value, log_decay, beta))
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    state = (
        torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    output = torch.empty(batch, heads, length, value_dim, dtype=torch.float32, device=value.device)
    for t in range(length):
        k_t = key[:, :, t]  # [B, H, K]
        state = state * log_decay[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        correction = (value[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k_t[..., :, None] * correction[..., None, :]
        output[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, query[:, :, t])
    return output, state
