"""The one place that picks a gated-delta-rule backend for a call.

- CUDA tensors with flash-linear-attention installed (and HYPIC_RAG_KERNELS != "torch"): fla's chunked kernel
  (`hypic_rag.kernels.gated_delta_rule`).
- Otherwise a few tokens (decode steps): the step-by-step recurrence (`recurrent.py`).
- Otherwise the chunked WY implementation in torch (`chunk.py`).
All backends share one contract: head-major [B, H, T, D] inputs, float32 outputs [B, H, T, V] and state [B, H, K, V].
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.gated_delta_rule.chunk import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import fused_recurrent_gated_delta_rule

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""


def select_backend(query: torch.Tensor) -> str:
    """"fla", "recurrent" or "chunk" for inputs shaped like `query` [B, H, T, K]."""
    length = query.shape[2]
    if query.is_cuda and length > 0:
        from hypic_rag.kernels.gated_delta_rule import fla_available

        if fla_available():
            return "fla"
    return "recurrent" if length <= RECURRENT_MAX_TOKENS else "chunk"


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
    if backend == "fla":
        from hypic_rag.kernels.gated_delta_rule import fla_chunk_gated_delta_rule

        return fla_chunk_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    if backend == "recurrent":
        return fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    return chunk_gated_delta_rule(query, key, value, log_decay, beta, initial_state, chunk_size)
