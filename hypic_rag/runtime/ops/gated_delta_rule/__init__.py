"""Gated delta rule (Gated DeltaNet): S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t.

Layout follows fla: state S per head is [K, V]; inputs are head-major [B, H, T, D].
`naive.py` is the token-by-token float32 reference, `chunk.py` the chunked (WY) torch implementation,
`recurrent.py` the step-by-step path for decode, `transition.py` the transition operator P of a span via the
identity-start trick. `gated_delta_rule` and `gated_delta_rule_varlen` run the backend `ops/registry.py` picks (fla
on CUDA, recurrent for a few tokens, chunked).
"""

from typing import Any

import torch

from hypic_rag.runtime.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import fused_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.transition import gated_delta_rule_with_transition
from hypic_rag.runtime.ops.registry import dispatch, dispatch_packed, select


def select_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """The backend for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    return select("gated_delta_rule", query, longest)


@dispatch("gated_delta_rule", like=chunk_gated_delta_rule)
def gated_delta_rule(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule through the backend the registry picks; contract of `chunk_gated_delta_rule`: head-major
    [B, H, T, D] inputs, float32 outputs [B, H, T, V] and state [B, H, K, V]."""


@dispatch_packed("gated_delta_rule", like=naive_recurrent_gated_delta_rule)
def gated_delta_rule_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay, beta [1, H, T] with
    sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1 (cu_seqlens [N + 1], 0 .. T, non-decreasing);
    initial_state [N, H, K, V] or None (zeros). Returns output [1, H, T, V] and final states [N, H, K, V], float32.
    """


__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "gated_delta_rule",
    "gated_delta_rule_varlen",
    "gated_delta_rule_with_transition",
    "naive_recurrent_gated_delta_rule",
    "select_backend",
]
