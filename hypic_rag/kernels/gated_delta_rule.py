"""The gated delta rule on CUDA through flash-linear-attention (fla): chunked and fused-recurrent, varlen.

Same contract as `hypic_rag.runtime.ops.gated_delta_rule.chunk_gated_delta_rule` (head-major [B, H, T, D] inputs,
query already l2-normalised and scaled, float32 outputs and state); the ops registry (`hypic_rag.runtime.ops.registry`)
calls these for CUDA tensors when `ops.backends.use_fla` says so:
- `fla_chunk_gated_delta_rule`: encoding, seams with a start state, and the identity-start transition operator
  (that trick only widens the value dimension to V + K);
- `fla_fused_recurrent_gated_delta_rule`: decode steps (a few tokens, no chunk padding);
- `cu_seqlens` (both): sequences packed along time in a batch of one, each with its own start and final state.
fla's API (checked against fla-core 0.6.0): `chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
output_final_state, cu_seqlens=...)` with time-major [B, T, H, D] inputs, `g` the log decay [B, T, H].
"""

from __future__ import annotations

import torch

from hypic_rag.kernels.fla_support import run_fla


def fla_chunk_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay, beta [B, H, T]; initial_state [N, H, K, V] or None;
    cu_seqlens [N + 1] int64 (B = 1, sequences packed along T) or None (N = B).
    Returns output [B, H, T, V] and final states [N, H, K, V], float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return run_fla(chunk_gated_delta_rule, query, key, value, log_decay, initial_state, cu_seqlens, beta)


def fla_fused_recurrent_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's token-by-token kernel (decode: one program per head and value block walks the tokens with the state in
    registers). Same contract as `fla_chunk_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return run_fla(fused_recurrent_gated_delta_rule, query, key, value, log_decay, initial_state, cu_seqlens, beta)
