"""Scalar-decay linear attention on CUDA through flash-linear-attention's simple GLA: chunked and fused-recurrent.

S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t with one log decay g_t per head and token: MiniMax's lightning
attention (g = -slope_h) and, with q = c, k = dt b, v = x, g = dt a, the SSD / Mamba2 recurrence
(`hypic_rag.runtime.ops.ssd.simple_gla` does that mapping). Head-major [B, H, T, D] inputs, log_decay [B, H, T],
float32 outputs [B, H, T, V] and states [N, H, K, V]; the dispatches in `runtime/ops/lightning` and `runtime/ops/ssd`
call these for CUDA tensors when `ops.backends.use_fla` says so. fla's API (checked against fla-core 0.6.0):
`chunk_simple_gla(q, k, v, g, g_gamma, scale, initial_state, output_final_state, cu_seqlens=...)` and
`fused_recurrent_simple_gla(...)` with time-major [B, T, H, D] inputs and g [B, T, H].
"""

from __future__ import annotations

import torch

from hypic_rag.kernels.fla_support import check_varlen, head_major_float, start_state, time_major


def _call(function, query, key, value, log_decay, initial_state, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    check_varlen(query, cu_seqlens, initial_state)
    output, final_state = function(
        q=time_major(query),
        k=time_major(key),
        v=time_major(value),
        g=time_major(log_decay).float(),
        scale=1.0,
        initial_state=start_state(initial_state),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    return head_major_float(output), final_state.float()


def fla_chunk_simple_gla(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay [B, H, T]; initial_state [N, H, K, V] or None;
    cu_seqlens [N + 1] int64 (B = 1) or None (N = B). Returns output [B, H, T, V] and final states [N, H, K, V],
    float32."""
    from fla.ops.simple_gla import chunk_simple_gla

    return _call(chunk_simple_gla, query, key, value, log_decay, initial_state, cu_seqlens)


def fla_fused_recurrent_simple_gla(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's token-by-token simple GLA (decode). Same contract as `fla_chunk_simple_gla`."""
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    return _call(fused_recurrent_simple_gla, query, key, value, log_decay, initial_state, cu_seqlens)
