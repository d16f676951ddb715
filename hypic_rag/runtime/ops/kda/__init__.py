"""Kimi Delta Attention (KDA): the gated delta rule with a per-key-channel decay.

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t

(transformers' kimi_linear and bailing_hybrid linear layers). Layout follows fla: state S per head is [K, V]; inputs
are head-major [B, H, T, D], the log decay g is [B, H, T, K]. `naive.py` is the token-by-token float32 reference,
`chunk.py` the chunked (WY) torch implementation, `recurrent.py` the step-by-step path for decode, `transition.py`
the span's transition matrix P [B, H, K, K] via the identity-start trick. `kda` and `kda_varlen` run the backend
`ops/registry.py` picks (fla's KDA kernels on CUDA).
"""

from typing import Any

import torch

from hypic_rag.runtime.ops.kda.chunk import chunk_kda
from hypic_rag.runtime.ops.kda.naive import naive_recurrent_kda
from hypic_rag.runtime.ops.kda.recurrent import fused_recurrent_kda
from hypic_rag.runtime.ops.kda.transition import kda_with_transition
from hypic_rag.runtime.ops.registry import dispatch, dispatch_packed, select


def select_kda_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """The backend for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    return select("kda", query, longest)


@dispatch("kda", like=chunk_kda)
def kda(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA through the backend the registry picks; contract of `chunk_kda`: head-major [B, H, T, D] inputs, float32
    outputs [B, H, T, V] and state [B, H, K, V]."""


@dispatch_packed("kda", like=naive_recurrent_kda)
def kda_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay [1, H, T, K], beta
    [1, H, T], sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1; initial_state [N, H, K, V] or None.
    Returns output [1, H, T, V] and final states [N, H, K, V], float32."""


__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "kda",
    "kda_varlen",
    "kda_with_transition",
    "naive_recurrent_kda",
    "select_kda_backend",
]
