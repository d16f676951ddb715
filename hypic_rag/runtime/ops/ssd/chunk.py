"""Chunked SSD (Mamba2's state-space duality) in torch, exact up to float32 round-off.

Within a chunk of C tokens, with gamma = cumsum(dt * a) inside the chunk and S the state entering it (all per head):
    y_i  = sum_{j <= i} exp(gamma_i - gamma_j) dt_j (c_i . b_j) x_j  +  exp(gamma_i) S^T c_i  +  d x_i
    S'   = exp(gamma_C) S + sum_j exp(gamma_C - gamma_j) dt_j b_j x_j^T
The intra-chunk term and each chunk's own update are computed for all chunks at once; the cheap scan over chunks
(S' = decay * S + update) runs in order, and the state read is one batched product at the end. The scores c_i . b_j
are computed once per group of B/C and shared by the heads of that group. gamma only decreases (dt >= 0, a < 0), so
every exponent is <= 0 (no overflow), and the segment sums gamma_i - gamma_j are summed per segment
(`segment_decay`) rather than subtracted from one long cumulative sum. Padding tokens (dt = 0, x = 0) leave the
state untouched, so any length works, and right-padding a batch with dt = 0 gives every row its own final state.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.ssd.naive import check_ssd_shapes

DEFAULT_CHUNK_SIZE = 64


def segment_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(sum_{j < k <= i} log_decay_k) for i >= j, 0 above the diagonal: [..., C] -> [..., C, C].

    The sums are taken directly over each segment rather than as differences of one long cumulative sum, whose
    round-off grows with the sum's size (a chunk of strong decays sums to hundreds, where float32 spacing is 1e-5
    and more); segments near the diagonal, the ones exp does not flush to zero, stay exact.
    """
    length = log_decay.shape[-1]
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril(-1)
    terms = log_decay[..., :, None].expand(*log_decay.shape, length).masked_fill(~strictly_lower, 0.0)
    sums = terms.cumsum(-2)  # [..., i, j] = sum over j < k <= i
    return sums.masked_fill(~strictly_lower.logical_or(torch.eye(length, dtype=torch.bool, device=log_decay.device)),
                            float("-inf")).exp()


def chunk_ssd(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD; same contract as `naive_ssd`.

    Args:
        x: [batch, H, T, P]; dt: [batch, H, T] (>= 0); a: [H] (< 0); b, c: [batch, G, T, N], G divides H;
        d: [H] or None; initial_state: [batch, H, N, P] or None (zeros).
    Returns:
        output [batch, H, T, P] and final state [batch, H, N, P], float32.
    """
    check_ssd_shapes(x, dt, a, b, c)
    x, dt, a, b, c = (t.float() for t in (x, dt, a, b, c))
    batch, heads, length, head_dim = x.shape
    groups, state_size = b.shape[1], b.shape[-1]
    per_group = heads // groups
    device = x.device
    state = (
        torch.zeros(batch, heads, state_size, head_dim, dtype=torch.float32, device=device)
        if initial_state is None
        else initial_state.float()
    )
    if length == 0:
        return x.new_zeros(batch, heads, 0, head_dim), state.clone()

    chunk = min(chunk_size, length)
    padded = -(-length // chunk) * chunk
    pad = padded - length
    skip = x
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        b, c = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (b, c))
        dt = torch.nn.functional.pad(dt, (0, pad))
    num_chunks = padded // chunk

    # heads as [G, H/G] so the group's b and c broadcast over its heads
    x = x.reshape(batch, groups, per_group, num_chunks, chunk, head_dim)
    dt = dt.reshape(batch, groups, per_group, num_chunks, chunk)
    b = b.reshape(batch, groups, 1, num_chunks, chunk, state_size)
    c = c.reshape(batch, groups, 1, num_chunks, chunk, state_size)
    log_decay = dt * a.reshape(1, groups, per_group, 1, 1)  # [batch, G, H/G, n, C]
    gamma = log_decay.cumsum(-1)
    decay_matrix = segment_decay(log_decay)  # [batch, G, H/G, n, C, C]

    scores = c @ b.transpose(-1, -2)  # [batch, G, 1, n, C, C], shared by the group's heads
    weights = scores * decay_matrix * dt[..., None, :]
    output = weights @ x  # [batch, G, H/G, n, C, P]

    # each chunk's own contribution to the state it hands on (decay from j to the chunk end), and its total decay
    to_end = decay_matrix[..., -1, :] * dt  # [batch, G, H/G, n, C]
    updates = (b * to_end[..., None]).transpose(-1, -2) @ x  # [batch, G, H/G, n, N, P]
    chunk_decay = gamma[..., -1].exp()  # [batch, G, H/G, n]

    state = state.reshape(batch, groups, per_group, state_size, head_dim)
    entering = []
    for index in range(num_chunks):
        entering.append(state)
        state = state * chunk_decay[..., index, None, None] + updates[:, :, :, index]
    entering_states = torch.stack(entering, dim=3)  # [batch, G, H/G, n, N, P]
    output = output + gamma.exp()[..., None] * (c @ entering_states)

    output = output.reshape(batch, heads, padded, head_dim)[:, :, :length]
    if d is not None:
        output = output + d.float()[None, :, None, None] * skip
    return output, state.reshape(batch, heads, state_size, head_dim)
