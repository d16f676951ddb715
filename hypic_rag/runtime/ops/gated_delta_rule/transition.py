"""The affine map of a span: S_end = P S_0 + Z, obtained with the identity-start trick.

The delta rule acts on each column of the state independently, so running the span once with start [0 | I] and
values [v | 0] evolves both Z (zero-start state, V columns) and P (K columns) in one pass. The outputs split the
same way: o_t = Z_t^T q_t + (P_t^T q_t) applied to S_0, so the real outputs for any later start state S_0 are
`output_zero_start + output_transition @ S_0` without running the span again.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.registry import call
from hypic_rag.runtime.segment_state import SegmentState


def gated_delta_rule_with_transition(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor, beta: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, SegmentState]:
    """Run a span from the identity start and return its outputs and affine map.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay, beta: [B, H, T].
    Returns:
        output_zero_start [B, H, T, V]: outputs when the span starts from S_0 = 0;
        output_transition [B, H, T, K]: P_t^T q_t, so outputs for start S_0 add output_transition @ S_0;
        SegmentState with transition P [B, H, K, K] and state Z [B, H, K, V] .
    """
    return delta_rule_with_transition("gated_delta_rule", query, key, value, log_decay, beta, chunk_size)


def delta_rule_with_transition(
    op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    beta: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, SegmentState]:
    """The identity-start run of the delta rule `op` ("gated_delta_rule", "kda": any log_decay it takes); returns
    what `gated_delta_rule_with_transition` does."""
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    augmented_value = torch.cat([value.float(), value.new_zeros(batch, heads, length, key_dim).float()], dim=-1)
    start = torch.zeros(batch, heads, key_dim, value_dim + key_dim, dtype=torch.float32, device=value.device)
    start[..., value_dim:] = torch.eye(key_dim, dtype=torch.float32, device=value.device)
    output, end = call(op, query=query, key=key, value=augmented_value, log_decay=log_decay, beta=beta,
                       initial_state=start, chunk_size=chunk_size)
    segment = SegmentState(transition=end[..., value_dim:].contiguous(), state=end[..., :value_dim].contiguous())
    return output[..., :value_dim], output[..., value_dim:], segment
