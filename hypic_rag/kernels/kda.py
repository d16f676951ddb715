"""Kimi Delta Attention on CUDA through flash-linear-attention (fla): chunked and fused-recurrent, varlen.

Same contract as `hypic_rag.runtime.ops.kda.chunk_kda` (head-major [B, H, T, D] inputs, query already
l2-normalised and scaled, the per-key-channel log decay [B, H, T, K], float32 outputs and state); the ops registry
(`hypic_rag.runtime.ops.registry`) calls these for CUDA tensors when `ops.backends.use_fla` says so. fla's API (checked
against fla-core 0.6.0): `chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=...)`
and `fused_recurrent_kda(...)` with time-major inputs, `g` [B, T, H, K] the log decay already computed (the
gate is not fused: `use_gate_in_kernel=False`), `beta` after its sigmoid, float32 `initial_state` [N, H, K, V];
the same recurrence as ours, S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t.
"""

from __future__ import annotations

import torch

from hypic_rag.kernels.fla_support import run_fla


def fla_chunk_kda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay [B, H, T, K]; beta [B, H, T]; initial_state
    [N, H, K, V] or None; cu_seqlens [N + 1] int64 (B = 1) or None (N = B).
    Returns output [B, H, T, V] and final states [N, H, K, V], float32."""
    from fla.ops.kda import chunk_kda

    return run_fla(chunk_kda, query, key, value, log_decay, initial_state, cu_seqlens, beta)


def fla_fused_recurrent_kda(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's token-by-token KDA (decode). Same contract as `fla_chunk_kda`."""
    from fla.ops.kda import fused_recurrent_kda

    return run_fla(fused_recurrent_kda, query, key, value, log_decay, initial_state, cu_seqlens, beta)
