"""The one place that picks a KDA backend for a call: the step-by-step recurrence (`recurrent.py`) for a few tokens
(decode), the chunked implementation (`chunk.py`) otherwise. Both share one contract: head-major [B, H, T, D]
inputs, float32 outputs [B, H, T, V] and state [B, H, K, V]. (fla's `chunk_kda` could join here on CUDA, as fla's
gated-delta-rule kernels do for Gated DeltaNet; it is not wired yet.)
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.kda.chunk import DEFAULT_CHUNK_SIZE, chunk_kda
from hypic_rag.runtime.ops.kda.recurrent import fused_recurrent_kda

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""


def select_kda_backend(query: torch.Tensor) -> str:
    """"recurrent" or "chunk" for inputs shaped like `query` [B, H, T, K]."""
    return "recurrent" if query.shape[2] <= RECURRENT_MAX_TOKENS else "chunk"


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
    if select_kda_backend(query) == "recurrent":
        return fused_recurrent_kda(query, key, value, log_decay, beta, initial_state)
    return chunk_kda(query, key, value, log_decay, beta, initial_state, chunk_size)
