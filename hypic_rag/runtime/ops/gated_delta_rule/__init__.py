"""Gated delta rule (Gated DeltaNet): S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t.

Layout follows fla: state S per head is [K, V]; inputs are head-major [B, H, T, D].
`naive.py` is the token-by-token float32 reference, `chunk.py` the chunked (WY) torch implementation,
`recurrent.py` the step-by-step path for decode, `transition.py` the transition operator P of a span via the
identity-start trick; `dispatch.py` picks the backend for a call (fla on CUDA, recurrent for a few tokens,
chunked) and runs packed variable-length sequences (`gated_delta_rule_varlen`).
"""

from hypic_rag.runtime.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.dispatch import gated_delta_rule, gated_delta_rule_varlen, select_backend
from hypic_rag.runtime.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import fused_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.transition import gated_delta_rule_with_transition

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_varlen",
    "gated_delta_rule_with_transition",
    "naive_recurrent_gated_delta_rule",
    "select_backend",
]
