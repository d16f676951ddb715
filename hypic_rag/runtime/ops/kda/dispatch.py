"""The one place that picks a KDA backend for a call (`ops/backends.py` says whether fla may run).

- CUDA tensors with flash-linear-attention: fla's fused recurrent KDA for a few tokens (decode), its chunked KDA
  otherwise (`hypic_rag.kernels.kda`); `cu_seqlens` for packed runs (`kda_varlen`).
- Otherwise the step-by-step recurrence (`recurrent.py`) for a few tokens, the chunked WY form (`chunk.py`) else.
All share one contract: head-major [B, H, T, D] inputs, float32 outputs [B, H, T, V] and state [B, H, K, V].
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.kda.chunk import DEFAULT_CHUNK_SIZE, chunk_kda
from hypic_rag.runtime.ops.kda.recurrent import fused_recurrent_kda
from hypic_rag.runtime.ops.varlen import each_sequence, fla_backend, offsets, packed_bounds

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("fla", "fla_recurrent", "recurrent", "chunk")


def select_kda_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """One of `BACKENDS` for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    few = (query.shape[2] if longest is None else longest) <= RECURRENT_MAX_TOKENS
    if query.shape[2] > 0 and backends.use_fla(query, "kda"):
        return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


def kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA through the backend `select_kda_backend` picks; contract of `chunk_kda`."""
    backend = select_kda_backend(query)
    if backend in ("fla", "fla_recurrent"):
        from hypic_rag.kernels import kda as fla

        run = fla.fla_chunk_kda if backend == "fla" else fla.fla_fused_recurrent_kda
        return run(query, key, value, log_decay, beta, initial_state)
    if backend == "recurrent":
        return fused_recurrent_kda(query, key, value, log_decay, beta, initial_state)
    return chunk_kda(query, key, value, log_decay, beta, initial_state, chunk_size)


def kda_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay [1, H, T, K], beta
    [1, H, T], sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1; initial_state [N, H, K, V] or None.
    Returns output [1, H, T, V] and final states [N, H, K, V], float32."""
    bounds = packed_bounds(cu_seqlens, query, initial_state)
    heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    backend = fla_backend(select_kda_backend, query, bounds)
    if backend is not None:
        from hypic_rag.kernels import kda as fla

        run = fla.fla_chunk_kda if backend == "fla" else fla.fla_fused_recurrent_kda
        return run(query, key, value, log_decay, beta, initial_state, offsets(bounds, query.device))
    return each_sequence(kda, (query, key, value, log_decay, beta), bounds, initial_state,
                         (1, heads, query.shape[2], value_dim), (heads, key_dim, value_dim))
