"""Chunked gated delta rule in torch (WY representation), exact up to float32 round-off.

Within a chunk of C tokens, with gamma = cumsum(g) inside the chunk and S the state entering it, the corrected
values u_t = b_t (v_t - exp(g_t) S_{t-1}^T k_t) satisfy (I + A) U = b*V - b*exp(gamma)*K S with A strictly lower
triangular, A_ij = b_i exp(gamma_i - gamma_j) k_i.k_j. Writing T = (I + A)^-1:
    U = T (b*V) - T (b*exp(gamma)*K) S
    O = (Q*exp(gamma)) S + [tril(Q K^T * exp(gamma_i - gamma_j))] U
    S' = exp(gamma_C) S + (K*exp(gamma_C - gamma))^T U
Everything but the last three lines is computed for all chunks at once (`chunk_terms`); the chunks are then
scanned in order. Padding tokens (g = 0, b = 0) leave the state untouched, so any length works.

`chunk_gated_delta_rule_packed` scans several runs (a request's seam windows and question) in order from one start
state, applying a caller's map between runs (the cached spans between them: S <- P S + Z): one batched
precompute for all runs and one scan, without the identity-start widening of `transition.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hypic_rag.runtime.threads import serial_section

DEFAULT_CHUNK_SIZE = 64


SUBSTITUTION_BLOCK = 16
"""Blocks up to this size are inverted by forward substitution; larger ones by halves (`unit_lower_inverse`)."""


def _forward_substitution(strictly_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 row by row: row i of T is e_i - sum_{j<i} A_ij T_j (C - 1 batched vector steps)."""
    size = strictly_lower.shape[-1]
    inverse = torch.zeros_like(strictly_lower)
    inverse.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    for row in range(1, size):
        # T[row, :row] = -A[row, :row] @ T[:row, :row]  (T[:row, :row] already final)
        inverse[..., row, :row] = -(strictly_lower[..., row : row + 1, :row] @ inverse[..., :row, :row])[..., 0, :]
    return inverse


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., C, C] strictly lower triangular.

    Up to `SUBSTITUTION_BLOCK` rows by forward substitution; beyond, by halves: with A = [[X, 0], [B, Y]],
    (I + A)^-1 = [[X', 0], [-Y' B X', Y']] where X' = (I + X)^-1, Y' = (I + Y)^-1, both halves inverted in ONE
    batched call (so a 64 x 64 chunk costs 15 substitution steps and two levels of products, not 63 steps).
    Same result as a triangular solve against the identity to float32 round-off; `torch.linalg.solve_triangular`
    on many small matrices costs ~25x more on CPU (8 x 8) and several times more (64 x 64). Under autograd (training
    through the chunked form) it is the triangular solve itself: the in-place rows would break the graph.
    """
    size = strictly_lower.shape[-1]
    if torch.is_grad_enabled() and strictly_lower.requires_grad:
        identity = torch.eye(size, dtype=strictly_lower.dtype, device=strictly_lower.device)
        return torch.linalg.solve_triangular(
            strictly_lower + identity, identity.expand_as(strictly_lower), upper=False, unitriangular=True
        )
    if size <= SUBSTITUTION_BLOCK or size % 2:
        return _forward_substitution(strictly_lower)
    half = size // 2
    halves = unit_lower_inverse(torch.stack([strictly_lower[..., :half, :half], strictly_lower[..., half:, half:]]))
    first, second = halves[0], halves[1]
    inverse = strictly_lower.new_zeros(strictly_lower.shape)
    inverse[..., :half, :half] = first
    inverse[..., half:, half:] = second
    inverse[..., half:, :half] = -(second @ (strictly_lower[..., half:, :half] @ first))
    return inverse


SCAN_OUTPUT_BLOCK = 16
"""`ChunkTerms.scan` computes the outputs of this many chunks at a time (it keeps their start states until then)."""


@dataclass(slots=True)
class ChunkTerms:
    """The state-independent terms of every chunk, chunk-major with batch and heads flattened (G = B * H) so a scan
    step reads contiguous memory and runs fused batched products.

    For N chunks of C tokens: corrected_values [N, G, C, V] (T b V), state_read_weights [N, G, C, K]
    (T b exp(gamma) K), query_decayed [N, G, C, K], intra_attention [N, G, C, C], key_to_end_transposed
    [N, G, K, C], chunk_decay [N, G, 1, 1].
    """

    corrected_values: torch.Tensor
    state_read_weights: torch.Tensor
    query_decayed: torch.Tensor
    intra_attention: torch.Tensor
    key_to_end_transposed: torch.Tensor
    chunk_decay: torch.Tensor

    @property
    def chunks(self) -> int:
        return int(self.chunk_decay.shape[0])

    def step(self, index: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk `index` from state [G, K, V]: (outputs [G, C, V], the state after the chunk). The one-chunk
        reference of `scan`."""
        updates = torch.baddbmm(self.corrected_values[index], self.state_read_weights[index], state, alpha=-1.0)
        output = torch.baddbmm(self.intra_attention[index] @ updates, self.query_decayed[index], state)
        return output, torch.baddbmm(state * self.chunk_decay[index], self.key_to_end_transposed[index], updates)

    def scan(
        self, state: torch.Tensor, before_chunk: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        block: int = SCAN_OUTPUT_BLOCK,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every chunk in order from state [G, K, V]: (outputs [N, G, C, V], the final state [G, K, V]).

        before_chunk(n, state) gives the state chunk n starts from (None: where chunk n - 1 left it). The loop runs
        only what the next state needs (U = T b V - W S, S' = d S + K~^T U: two products and a scale per chunk);
        the outputs O = intra U + Q~ S, which nothing downstream in the loop reads, follow for `block` chunks at
        a time in two batched products from the kept start states and updates (memory: `block` states)."""
        chunks, groups, chunk, value_dim = self.corrected_values.shape
        corrected_values = self.corrected_values.unbind(0)
        state_read_weights = self.state_read_weights.unbind(0)
        key_to_end_transposed = self.key_to_end_transposed.unbind(0)
        chunk_decay = self.chunk_decay.unbind(0)
        blocks: list[torch.Tensor] = []  # out of place throughout: training runs this under autograd
        starts: list[torch.Tensor] = []
        updates: list[torch.Tensor] = []
        first = 0
        for index in range(chunks):
            if before_chunk is not None:
                state = before_chunk(index, state)
            update = torch.baddbmm(corrected_values[index], state_read_weights[index], state, alpha=-1.0)
            starts.append(state)
            updates.append(update)
            state = torch.baddbmm(state * chunk_decay[index], key_to_end_transposed[index], update)
            if len(starts) == block or index == chunks - 1:
                last = index + 1
                intra = torch.bmm(self.intra_attention[first:last].reshape(-1, chunk, chunk),
                                  torch.stack(updates).reshape(-1, chunk, value_dim))
                block_outputs = torch.baddbmm(
                    intra, self.query_decayed[first:last].reshape(-1, chunk, state.shape[-2]),
                    torch.stack(starts).reshape(-1, *state.shape[-2:]),
                )
                blocks.append(block_outputs.view(last - first, groups, chunk, value_dim))
                starts, updates, first = [], [], last
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks)), state


def chunk_terms(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    chunk: int,
) -> ChunkTerms:
    """`ChunkTerms` of float32 inputs query, key [B, H, T, K], value [B, H, T, V], log_decay, beta [B, H, T] cut
    into chunks of `chunk` tokens (T padded at its end with identity steps to a multiple of `chunk`)."""
    batch, heads, length, key_dim = key.shape
    device = value.device
    padded = -(-length // chunk) * chunk
    pad = padded - length
    if pad:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        log_decay, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (log_decay, beta))
    num_chunks = padded // chunk

    def chunk_major(x: torch.Tensor) -> torch.Tensor:  # [B, H, N * C, ...] -> [N, B * H, C, ...]
        split = x.reshape(batch, heads, num_chunks, chunk, *x.shape[3:])
        return split.permute(2, 0, 1, *range(3, split.dim())).reshape(num_chunks, batch * heads, chunk, *x.shape[3:])

    # chunk-major from the start, so every term below is laid out as the scan reads it (no copies at the end)
    query, key, value, log_decay, beta = (chunk_major(x).contiguous() for x in (query, key, value, log_decay, beta))
    gamma = log_decay.cumsum(-1)  # [N, G, C]
    # exp(gamma_i - gamma_j) for i >= j, zero above the diagonal (masked before exp: no overflow)
    lower_inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    gamma_difference = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower_inclusive, float("-inf"))
    decay_matrix = gamma_difference.exp()  # [N, G, C, C]

    key_beta = key * beta[..., None]
    strictly_lower = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(-1)
    interaction = (key_beta @ key.transpose(-1, -2) * decay_matrix).masked_fill(~strictly_lower, 0.0)
    inverse = unit_lower_inverse(interaction)  # T = (I + A)^-1, unit lower triangular
    gamma_exp = gamma.exp()[..., None]
    corrected_values = inverse @ (value * beta[..., None])  # [N, G, C, V]
    state_read_weights = inverse @ (key_beta * gamma_exp)  # [N, G, C, K]
    intra_attention = query @ key.transpose(-1, -2) * decay_matrix  # [N, G, C, C], lower incl. diagonal
    query_decayed = query * gamma_exp
    key_to_end_transposed = (key * (gamma[..., -1:] - gamma).exp()[..., None]).transpose(-1, -2).contiguous()
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [N, G, 1, 1]

    return ChunkTerms(
        corrected_values, state_read_weights, query_decayed, intra_attention, key_to_end_transposed, chunk_decay
    )


def chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
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
    state = (
        torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float()
    )
    if length == 0:
        return value.new_zeros(batch, heads, 0, value_dim), state.clone()
    chunk = min(chunk_size, length)
    terms = chunk_terms(query, key, value, log_decay, beta, chunk)
    state = state.reshape(batch * heads, key_dim, value_dim)
    outputs, state = terms.scan(state)  # [N, G, C, V]
    output = outputs.permute(1, 0, 2, 3).reshape(batch, heads, -1, value_dim)[:, :, :length]
    return output, state.reshape(batch, heads, key_dim, value_dim)


SMALL_OPS_MAX_ELEMENTS = 1 << 20
"""A packed scan whose values hold at most this many elements runs as a serial section (`runtime/threads.py`): its
many few-microsecond products on one CPU thread (docs/runtime.md), large compositions still widened by `wide_for`."""


BetweenRuns = Callable[[int, torch.Tensor], torch.Tensor]
"""before_run(r, state [H, K, V]) -> the state run r starts from (what sits between run r - 1 and run r)."""


def chunk_gated_delta_rule_packed(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    lengths: list[int], initial_state: torch.Tensor, before_run: BetweenRuns | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of one sequence packed end to end along time, in order: run r (steps sum(lengths[:r]) ..) starts from
    `before_run(r, state)` where state is where run r - 1 ended (`initial_state` for r = 0).

    Args:
        query, key: [1, H, T, K]; value: [1, H, T, V]; log_decay, beta: [1, H, T] with T = sum(lengths);
        lengths: positive run lengths; initial_state: [H, K, V]; before_run: None for no map between runs.
    Returns:
        outputs [1, H, T, V] and the end state [H, K, V], float32.
    Each run is padded with identity steps to whole chunks; the chunk is the longest run but the last, capped at
    `chunk_size` (so each seam window is one scan step), and every chunk's terms are computed in one batch.
    """
    query, key, value, log_decay, beta = (x.float() for x in (query, key, value, log_decay, beta))
    _, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    if query.shape[0] != 1 or any(count < 1 for count in lengths) or sum(lengths) != length:
        raise ValueError(f"lengths {lengths} must be positive and sum to the {length} packed steps of a batch of one")
    state = initial_state.float()
    chunk = min(chunk_size, max(lengths[:-1]) if len(lengths) > 1 else lengths[0])
    run_chunks = [-(-count // chunk) for count in lengths]
    # padded layout: each run rounded up to whole chunks; padding rows read the zero row appended at index T
    source: list[int] = []
    first = 0
    for count, chunks in zip(lengths, run_chunks):
        source.extend(range(first, first + count))
        source.extend([length] * (chunks * chunk - count))
        first += count
    device = value.device
    if len(source) == length:
        padded = [query, key, value, log_decay, beta]
        real_rows = None
    else:
        index = torch.tensor(source, dtype=torch.long, device=device)
        padded = [torch.nn.functional.pad(x, (0, 0, 0, 1)).index_select(2, index) for x in (query, key, value)]
        padded += [torch.nn.functional.pad(x, (0, 1)).index_select(2, index) for x in (log_decay, beta)]
        real_rows = torch.tensor([row for row, at in enumerate(source) if at < length], dtype=torch.long, device=device)
    run_of_first_chunk: dict[int, int] = {}  # chunk index -> the run it starts
    number = 0
    for run, chunks in enumerate(run_chunks):
        run_of_first_chunk[number] = run
        number += chunks

    def before_chunk(index: int, state: torch.Tensor) -> torch.Tensor:
        run = run_of_first_chunk.get(index)
        return state if run is None or before_run is None else before_run(run, state).float()

    with serial_section(padded[2].numel(), device, limit=SMALL_OPS_MAX_ELEMENTS):
        terms = chunk_terms(*padded, chunk)
        outputs, state = terms.scan(state, before_chunk)  # [N, H, C, V]
    output = outputs.permute(1, 0, 2, 3).reshape(1, heads, -1, value_dim)  # [1, H, padded T, V]
    if real_rows is not None:
        output = output.index_select(2, real_rows)
    return output, state
