"""The one place that picks a gated-delta-rule backend for a call (`ops/backends.py` says whether fla may run).

- CUDA tensors with flash-linear-attention: fla's fused recurrent kernel for a few tokens (decode), its chunked
  kernel otherwise (`hypic_rag.kernels.gated_delta_rule`).
- Otherwise a few tokens (decode steps): the step-by-step recurrence (`recurrent.py`).
- Otherwise the chunked WY implementation in torch (`chunk.py`).
All backends share one contract: head-major [B, H, T, D] inputs, float32 outputs [B, H, T, V] and state [B, H, K, V].
`gated_delta_rule_varlen` takes sequences packed along time (`cu_seqlens`), each with its own start state: fla's
varlen kernels on CUDA, one call per sequence elsewhere.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.gated_delta_rule.chunk import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import fused_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.varlen import each_sequence, fla_backend, offsets, packed_bounds

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("fla", "fla_recurrent", "recurrent", "chunk")


def select_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """One of `BACKENDS` for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    length = query.shape[2] if longest is None else longest
    few = length <= RECURRENT_MAX_TOKENS
    if query.shape[2] > 0 and backends.use_fla(query, "gated_delta_rule"):
        return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule through the backend `select_backend` picks; contract of `chunk_gated_delta_rule`."""
    backend = select_backend(query)
    if backend in ("fla", "fla_recurrent"):
        from hypic_rag.kernels import gated_delta_rule as fla

        run = fla.fla_chunk_gated_delta_rule if backend == "fla" else fla.fla_fused_recurrent_gated_delta_rule
        return run(query, key, value, log_decay, beta, initial_state)
    if backend == "recurrent":
        return fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    return chunk_gated_delta_rule(query, key, value, log_decay, beta, initial_state, chunk_size)


def gated_delta_rule_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay, beta [1, H, T] with
    sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1 (cu_seqlens [N + 1], 0 .. T, non-decreasing);
    initial_state [N, H, K, V] or None (zeros). Returns output [1, H, T, V] and final states [N, H, K, V], float32.
    """
    bounds = packed_bounds(cu_seqlens, query, initial_state)
    heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    backend = fla_backend(select_backend, query, bounds)
    if backend is not None:
        from hypic_rag.kernels import gated_delta_rule as fla

        run = fla.fla_chunk_gated_delta_rule if backend == "fla" else fla.fla_fused_recurrent_gated_delta_rule
        return run(query, key, value, log_decay, beta, initial_state, offsets(bounds, query.device))
    return each_sequence(gated_delta_rule, (query, key, value, log_decay, beta), bounds, initial_state,
                         (1, heads, query.shape[2], value_dim), (heads, key_dim, value_dim))
