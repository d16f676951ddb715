"""Token-by-token float32 reference of linear attention with a scalar decay per head and token. Slow; the ground
truth for tests."""

from __future__ import annotations

import torch


def naive_recurrent_lightning(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, one token at a time.

    Args:
        query, key: [B, H, T, K] (MiniMax: silu-activated, unscaled).
        value: [B, H, T, V].
        log_decay: broadcastable to [B, H, T]: [H, 1] for MiniMax's constant -slope per head, [B, H, T] for a
            per-token scalar decay (simple GLA / Mamba2-style).
        initial_state: [B, H, K, V] or None (zeros).
    Returns:
        output [B, H, T, V] (read after the update) and final state [B, H, K, V], both float32.
    """
    query, key, value = (x.float() for x in (query, key, value))
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(batch, heads, length).exp()
    state = (
        torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    output = torch.empty(batch, heads, length, value_dim, dtype=torch.float32, device=value.device)
    for t in range(length):
        state = state * decay[:, :, t, None, None] + key[:, :, t, :, None] * value[:, :, t, None, :]
        output[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, query[:, :, t])
    return output, state
