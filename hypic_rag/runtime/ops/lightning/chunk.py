"""Chunked scalar-decay linear attention in torch (lightning attention's block form), exact up to float32 round-off.

Within a chunk of C tokens, with gamma = cumsum(g) inside the chunk (a scalar per head and token) and S the state
entering it:
    O  = (Q*exp(gamma)) S + [tril(Q K^T * exp(gamma_i - gamma_j))] V
    S' = exp(gamma_C) S + (K*exp(gamma_C - gamma))^T V
No solves: everything but the state hand-over is computed for all chunks at once, then the chunks are scanned in
order. All exponents are sums of log decays inside the chunk (<= 0 for g <= 0): no overflow. Padding tokens (g = 0,
k = 0) leave the state untouched.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 64


def chunk_lightning(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form; same contract as `naive_recurrent_lightning`.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay: broadcastable to [B, H, T];
        initial_state: [B, H, K, V] or None.
    Returns:
        output [B, H, T, V] and final state [B, H, K, V], float32.
    """
    query, key, value = (x.float() for x in (query, key, value))
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    device = value.device
    log_decay = log_decay.to(device=value.device, dtype=torch.float32).expand(batch, heads, length)
    state = (
        torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=device)
        if initial_state is None
        else initial_state.float()
    )
    if length == 0:
        return value.new_zeros(batch, heads, 0, value_dim), state.clone()

    chunk = min(chunk_size, length)
    padded = -(-length // chunk) * chunk
    pad = padded - length
    if pad:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        log_decay = torch.nn.functional.pad(log_decay, (0, pad))
    num_chunks = padded // chunk

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, num_chunks, chunk, *x.shape[3:])

    query, key, value, log_decay = map(split, (query, key, value, log_decay))
    gamma = log_decay.cumsum(-1)  # [B, H, N, C]
    lower_inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    decay_matrix = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower_inclusive, float("-inf")).exp()
    intra = (query @ key.transpose(-1, -2) * decay_matrix) @ value  # [B, H, N, C, V]
    query_decayed = query * gamma.exp()[..., None]
    contributions = (key * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2) @ value  # [B, H, N, K, V]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    entering = []
    for index in range(num_chunks):
        entering.append(state)
        state = state * chunk_decay[:, :, index] + contributions[:, :, index]
    output = intra + query_decayed @ torch.stack(entering, dim=2)
    return output.reshape(batch, heads, padded, value_dim)[:, :, :length], state
