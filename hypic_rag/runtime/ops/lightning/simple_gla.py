"""Scalar-decay linear attention through fla's simple-GLA kernels on CUDA (same recurrence: g broadcast over T)."""

from __future__ import annotations

import torch


def lightning_through_simple_gla(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None, *, recurrent: bool = False, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contract of `chunk_lightning` (log_decay broadcastable to [B, H, T]) through fla's chunked simple GLA
    (`recurrent`: its fused recurrent kernel); `cu_seqlens` [S + 1] for sequences packed along T in a batch of one.
    Returns output [B, H, T, V] and final states [S, H, K, V], float32."""
    from hypic_rag.kernels import simple_gla

    run = simple_gla.fla_fused_recurrent_simple_gla if recurrent else simple_gla.fla_chunk_simple_gla
    decay = log_decay.to(device=value.device, dtype=torch.float32).expand(*query.shape[:3])
    return run(query.float(), key.float(), value.float(), decay, initial_state, cu_seqlens)
