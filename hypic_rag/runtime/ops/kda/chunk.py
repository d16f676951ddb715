"""Chunked Kimi Delta Attention in torch (WY representation with a per-channel decay), exact up to float32 round-off.

Within a chunk of C tokens, with gamma_i = cumsum(g) inside the chunk (a vector over the K key channels) and S the
state entering it, the corrected values u_i = b_i (v_i - (Diag(exp(gamma_i)) S)^T k_i - ...) satisfy
(I + A) U = b*V - b*(K*exp(gamma)) S with A strictly lower triangular,
    A_ij = b_i sum_c k_ic k_jc exp(gamma_ic - gamma_jc).
Writing T = (I + A)^-1:
    U  = T (b*V) - T (b*K*exp(gamma)) S
    O  = (Q*exp(gamma)) S + M U,   M_ij = sum_c q_ic k_jc exp(gamma_ic - gamma_jc) for j <= i
    S' = Diag(exp(gamma_C)) S + (K*exp(gamma_C - gamma))^T U
Every exponent is a sum of log decays over a stretch inside the chunk, so it is <= 0 for g <= 0: no overflow however
strong the decay (the pairwise [C, C, K] decay tensor is built explicitly instead of factoring exp(gamma_i - gamma_j)
into exp(gamma_i) exp(-gamma_j), which overflows). To bound memory that tensor is built for a group of chunks at a
time; each group is then scanned in order. Padding tokens (g = 0, b = 0, k = 0) leave the state untouched.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.gated_delta_rule.chunk import unit_lower_inverse

DEFAULT_CHUNK_SIZE = 32
"""Tokens per chunk. The [C, C, K] pairwise decay makes the intra-chunk work grow with C (docs/runtime.md has the
sizes tried)."""
PAIRWISE_BUDGET = 1 << 24
"""Most elements of the [B, H, G, C, C, K] pairwise decay tensor built at once (64 MiB in float32)."""


def chunk_kda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA; same contract as `naive_recurrent_kda`.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay: [B, H, T, K]; beta: [B, H, T];
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
        query, key, value, log_decay = (
            torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value, log_decay)
        )
        beta = torch.nn.functional.pad(beta, (0, pad))
    num_chunks = padded // chunk

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch, heads, num_chunks, chunk, *x.shape[3:])

    query, key, value, log_decay, beta = map(split, (query, key, value, log_decay, beta))
    gamma = log_decay.cumsum(3)  # [B, H, N, C, K]
    lower_inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    strictly_lower = lower_inclusive.tril(-1)
    group = max(1, PAIRWISE_BUDGET // (batch * heads * chunk * chunk * key_dim))

    outputs = []
    for first in range(0, num_chunks, group):
        part = slice(first, min(first + group, num_chunks))
        q, k, v, g, b = query[:, :, part], key[:, :, part], value[:, :, part], gamma[:, :, part], beta[:, :, part]
        # exp(gamma_i - gamma_j) per channel for i >= j, zero above the diagonal (masked before exp: no overflow)
        pairwise = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(~lower_inclusive[..., None], float("-inf"))
        pairwise = pairwise.exp()  # [B, H, G, C, C, K]
        key_beta = k * b[..., None]
        interaction = torch.einsum("...ic,...jc,...ijc->...ij", key_beta, k, pairwise).masked_fill(~strictly_lower, 0.0)
        intra_attention = torch.einsum("...ic,...jc,...ijc->...ij", q, k, pairwise)  # lower incl. diagonal
        del pairwise
        inverse = unit_lower_inverse(interaction)  # T = (I + A)^-1 (forward substitution, chunk.py of gated delta)
        corrected_values = inverse @ (v * b[..., None])  # [.., C, V]
        state_read_weights = inverse @ (key_beta * g.exp())  # [.., C, K]
        query_decayed = q * g.exp()
        key_to_end_transposed = (k * (g[..., -1:, :] - g).exp()).transpose(-1, -2)  # [B, H, G, K, C]
        chunk_decay = g[..., -1, :].exp()[..., None]  # [B, H, G, K, 1]
        for index in range(corrected_values.shape[2]):
            updates = corrected_values[:, :, index] - state_read_weights[:, :, index] @ state
            outputs.append(query_decayed[:, :, index] @ state + intra_attention[:, :, index] @ updates)
            state = state * chunk_decay[:, :, index] + key_to_end_transposed[:, :, index] @ updates
    output = torch.stack(outputs, dim=2).reshape(batch, heads, padded, value_dim)[:, :, :length]
    return output, state
