"""Picks the scalar-decay linear-attention backend for a call: the step-by-step recurrence (`recurrent.py`) for a
few tokens (decode), the chunked form (`chunk.py`) otherwise; one contract (float32 outputs [B, H, T, V] and state
[B, H, K, V])."""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.lightning.chunk import DEFAULT_CHUNK_SIZE, chunk_lightning
from hypic_rag.runtime.ops.lightning.recurrent import fused_recurrent_lightning

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""


def lightning_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar-decay linear attention: the step path for T <= 4, else the chunked one; contract of `chunk_lightning`."""
    if query.shape[2] <= RECURRENT_MAX_TOKENS:
        return fused_recurrent_lightning(query, key, value, log_decay, initial_state)
    return chunk_lightning(query, key, value, log_decay, initial_state, chunk_size)
