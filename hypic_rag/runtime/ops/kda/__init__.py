"""Kimi Delta Attention (KDA): the gated delta rule with a per-key-channel decay.

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t

(transformers' kimi_linear and bailing_hybrid linear layers). Layout follows fla: state S per head is [K, V]; inputs
are head-major [B, H, T, D], the log decay g is [B, H, T, K]. `naive.py` is the token-by-token float32 reference,
`chunk.py` the chunked (WY) torch implementation, `recurrent.py` the step-by-step path for decode, `transition.py`
the span's transition matrix P [B, H, K, K] via the identity-start trick, `dispatch.py` picks the backend (fla's
KDA kernels on CUDA) and runs packed sequences (`kda_varlen`).
"""

from hypic_rag.runtime.ops.kda.chunk import chunk_kda
from hypic_rag.runtime.ops.kda.dispatch import kda, kda_varlen, select_kda_backend
from hypic_rag.runtime.ops.kda.naive import naive_recurrent_kda
from hypic_rag.runtime.ops.kda.recurrent import fused_recurrent_kda
from hypic_rag.runtime.ops.kda.transition import kda_with_transition

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "kda",
    "kda_varlen",
    "kda_with_transition",
    "naive_recurrent_kda",
    "select_kda_backend",
]
