"""Scalar-decay linear attention on CUDA through flash-linear-attention's simple GLA: chunked and fused-recurrent.

S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t with one log decay g_t per head and token: MiniMax's lightning
attention (g = -slope_h) and, with q = c, k = dt b, v = x, g = dt a, the SSD / Mamba2 recurrence
(`hypic_rag.runtime.ops.ssd.simple_gla` does that mapping). Head-major [B, H, T, D] inputs, log_decay [B, H, T],
float32 outputs [B, H, T, V] and states [N, H, K, V]; the ops registry runs `runtime/ops/lightning` and
`runtime/ops/ssd` through these for CUDA tensors when `ops.backends.use_fla` says so.
fla's API (checked against fla-core 0.6.0):
`chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens=...)` and
`fused_recurrent_simple_gla(...)` with time-major [B, T, H, D] inputs and g [B, T, H].
"""

from __future__ import annotations

import torch

from hypic_rag.kernels.fla_support import run_fla


def fla_chunk_simple_gla(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay [B, H, T]; initial_state [N, H, K, V] or None;
    cu_seqlens [N + 1] int64 (B = 1) or None (N = B). Returns output [B, H, T, V] and final states [N, H, K, V],
    float32."""
    from fla.ops.simple_gla import chunk_simple_gla

    return run_fla(chunk_simple_gla, query, key, value, log_decay, initial_state, cu_seqlens)


def fla_fused_recurrent_simple_gla(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's token-by-token simple GLA (decode). Same contract as `fla_chunk_simple_gla`."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    return run_fla(fused_recurrent_simple_gla, query, key, value, log_decay, initial_state, cu_seqlens)
