"""Chunked gated delta rule in torch (WY representation), exact up to float32 round-off.

Within a chunk of C tokens, with gamma = cumsum(g) inside the chunk and S the state entering it, the corrected
values u_t = b_t (v_t - exp(g_t) S_{t-1}^T k_t) satisfy (I + A) U = b*V - b*exp(gamma)*K S with A strictly lower
triangular, A_ij = b_i exp(gamma_i - gamma_j) k_i.k_j. Writing T = (I + A)^-1:
    U = T (b*V) - T (b*exp(gamma)*K) S
    O = (Q*exp(gamma)) S + [tril(Q K^T * exp(gamma_i - gamma_j))] U
    S' = exp(gamma_C) S + (K*exp(gamma_C - gamma))^T U
Everything but the last three lines is computed for all chunks at once; the chunks are then scanned in order.
Padding tokens (g = 0, b = 0, k = 0) leave the state untouched, so any length works.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 64


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., C, C] strictly lower triangular, by forward substitution over rows.

    Row i of T = (I + A)^-1 is e_i - sum_{j<i} A_ij T_j. Same arithmetic as a triangular solve against the
    identity, but batched over all leading dimensions in C - 1 vector steps: `torch.linalg.solve_triangular` on
    many small matrices costs ~25x more on CPU (8 x 8) and ~1.7x more (64 x 64).
    """
    size = strictly_lower.shape[-1]
    inverse = torch.zeros_like(strictly_lower)
    inverse.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    for row in range(1, size):
        # T[row, :row] = -A[row, :row] @ T[:row, :row]  (T[:row, :row] already final)
        inverse[..., row, :row] = -(strictly_lower[..., row : row + 1, :row] @ inverse[..., :row, :row])[..., 0, :]
    return inverse


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule; same contract as `naive_recurrent_gated_delta_rule`.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay, beta: [B, H, T];
        initial_state: [B, H, K, V] or None.
    Returns:
        output [B, H, T, V] and final state [B, H, K, V], float32.
    """
    query, key, value, log_decay, beta = (x.float() for x in (query, key, value, log_decay, beta))
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    device = value.device
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
        log_decay, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (log_decay, beta))
    num_chunks = padded // chunk

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, num_chunks, chunk, *x.shape[3:])

    query, key, value, log_decay, beta = map(split, (query, key, value, log_decay, beta))
    gamma = log_decay.cumsum(-1)  # [B, H, N, C]
    # exp(gamma_i - gamma_j) for i >= j, zero above the diagonal (masked before exp: no overflow)
    lower_inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    gamma_difference = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower_inclusive, float("-inf"))
    decay_matrix = gamma_difference.exp()  # [B, H, N, C, C]

    key_beta = key * beta[..., None]
    strictly_lower = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(-1)
    interaction = (key_beta @ key.transpose(-1, -2) * decay_matrix).masked_fill(~strictly_lower, 0.0)
    inverse = unit_lower_inverse(interaction)  # T = (I + A)^-1, unit lower triangular
    corrected_values = inverse @ (value * beta[..., None])  # [B, H, N, C, V]
    state_read_weights = inverse @ (key_beta * gamma.exp()[..., None])  # [B, H, N, C, K]
    intra_attention = query @ key.transpose(-1, -2) * decay_matrix  # [B, H, N, C, C], lower incl. diagonal
    query_decayed = query * gamma.exp()[..., None]
    key_to_end = key * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    # the scan over chunks reads one chunk of each tensor per step: lay them out chunk-major so each read is contiguous
    def chunk_major(x: torch.Tensor) -> torch.Tensor:
        return x.permute(2, 0, 1, *range(3, x.dim())).contiguous()

    corrected_values, state_read_weights, query_decayed, intra_attention, chunk_decay = map(
        chunk_major, (corrected_values, state_read_weights, query_decayed, intra_attention, chunk_decay)
    )
    key_to_end_transposed = chunk_major(key_to_end.transpose(-1, -2))  # [N, B, H, K, C]
    outputs = []
    for index in range(num_chunks):
        updates = corrected_values[index] - state_read_weights[index] @ state
        outputs.append(query_decayed[index] @ state + intra_attention[index] @ updates)
        state = state * chunk_decay[index] + key_to_end_transposed[index] @ updates
    output = torch.stack(outputs, dim=2).reshape(batch, heads, padded, value_dim)[:, :, :length]
    return output, state
