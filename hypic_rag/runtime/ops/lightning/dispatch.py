"""Picks the scalar-decay linear-attention backend for a call (`ops/backends.py` says whether fla may run).

- CUDA tensors with flash-linear-attention: fla's simple-GLA kernels (`hypic_rag.kernels.simple_gla`), fused
  recurrent for a few tokens, chunked otherwise; `cu_seqlens` for packed runs (`lightning_attention_varlen`).
- Otherwise the step path (`recurrent.py`) for a few tokens (decode), the chunked form (`chunk.py`) else.
One contract: float32 outputs [B, H, T, V] and state [B, H, K, V].
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.lightning.chunk import DEFAULT_CHUNK_SIZE, chunk_lightning
from hypic_rag.runtime.ops.lightning.recurrent import fused_recurrent_lightning
from hypic_rag.runtime.ops.varlen import each_sequence, fla_backend, offsets, packed_bounds

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("fla", "fla_recurrent", "recurrent", "chunk")


def select_lightning_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """One of `BACKENDS` for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    few = (query.shape[2] if longest is None else longest) <= RECURRENT_MAX_TOKENS
    if query.shape[2] > 0 and backends.use_fla(query, "simple_gla"):
        return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


def _through_fla(backend, query, key, value, log_decay, initial_state, cu_seqlens=None):
    from hypic_rag.kernels import simple_gla

    run = simple_gla.fla_chunk_simple_gla if backend == "fla" else simple_gla.fla_fused_recurrent_simple_gla
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(*query.shape[:3])
    return run(query.float(), key.float(), value.float(), decay, initial_state, cu_seqlens)


def lightning_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar-decay linear attention through the backend `select_lightning_backend` picks; contract of
    `chunk_lightning` (log_decay broadcastable to [B, H, T], e.g. [H, 1] for a constant decay per head)."""
    backend = select_lightning_backend(query)
    if backend in ("fla", "fla_recurrent"):
        return _through_fla(backend, query, key, value, log_decay, initial_state)
    if backend == "recurrent":
        return fused_recurrent_lightning(query, key, value, log_decay, initial_state)
    return chunk_lightning(query, key, value, log_decay, initial_state, chunk_size)


def lightning_attention_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay broadcastable to
    [1, H, T], sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1; initial_state [N, H, K, V] or None.
    Returns output [1, H, T, V] and final states [N, H, K, V], float32."""
    bounds = packed_bounds(cu_seqlens, query, initial_state)
    heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(*query.shape[:3])
    backend = fla_backend(select_lightning_backend, query, bounds)
    if backend is not None:
        return _through_fla(backend, query, key, value, decay, initial_state, offsets(bounds, query.device))
    return each_sequence(lightning_attention, (query, key, value, decay), bounds, initial_state,
                         (1, heads, query.shape[2], value_dim), (heads, key_dim, value_dim))
