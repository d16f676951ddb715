"""The affine map of a KDA span: S_end = P S_0 + Z, obtained with the identity-start trick.

Like the gated delta rule, KDA acts on each column of the state independently (the per-channel decay scales rows),
so running the span once with start [0 | I] and values [v | 0] evolves Z (zero-start state, V columns) and
P = A_T ... A_1 with A_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) (K columns) in one pass. The outputs split the same way:
the outputs for any later start S_0 are `output_zero_start + output_transition @ S_0`.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.gated_delta_rule.transition import delta_rule_with_transition
from hypic_rag.runtime.ops.kda.chunk import DEFAULT_CHUNK_SIZE
from hypic_rag.runtime.segment_state import SegmentState


def kda_with_transition(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, SegmentState]:
    """Run a span from the identity start and return its outputs and affine map.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay: [B, H, T, K]; beta: [B, H, T].
    Returns:
        output_zero_start [B, H, T, V]: outputs when the span starts from S_0 = 0;
        output_transition [B, H, T, K]: P_t^T q_t, so outputs for start S_0 add output_transition @ S_0;
        SegmentState with transition P [B, H, K, K] and state Z [B, H, K, V].
    """
    return delta_rule_with_transition("kda", query, key, value, log_decay, beta, chunk_size)
