"""Linear attention with a scalar decay per head (MiniMax lightning attention; also simple GLA / Mamba2-style
per-token scalar decays):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t

MiniMax uses a constant g = -slope_h per head (pass log_decay shaped [H, 1]). Layout follows fla: state S per head is
[K, V]; inputs are head-major [B, H, T, D]. `naive.py` is the token-by-token float32 reference, `chunk.py` the
chunked (block) form, `recurrent.py` the step path for decode, `simple_gla.py` the call into fla's simple-GLA kernels,
`transition.py` the span's scalar transition (`ScalarDecaySpan`), `slopes.py` MiniMax's per-head decays.
`lightning_attention` and `lightning_attention_varlen` run the backend `ops/registry.py` picks.
"""

from typing import Any

import torch

from hypic_rag.runtime.ops.lightning.chunk import chunk_lightning
from hypic_rag.runtime.ops.lightning.naive import naive_recurrent_lightning
from hypic_rag.runtime.ops.lightning.recurrent import fused_recurrent_lightning
from hypic_rag.runtime.ops.lightning.slopes import minimax_log_decay
from hypic_rag.runtime.ops.lightning.transition import (
    ScalarDecaySpan,
    lightning_with_transition,
)
from hypic_rag.runtime.ops.registry import dispatch, dispatch_packed, select


def select_lightning_backend(query: torch.Tensor, longest: int | None = None) -> str:
    """The backend for inputs shaped like `query` [B, H, T, K] (`longest`: the longest packed sequence)."""
    return select("lightning", query, longest)


@dispatch("lightning", like=chunk_lightning)
def lightning_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar-decay linear attention through the backend the registry picks; contract of `chunk_lightning`
    (log_decay broadcastable to [B, H, T], e.g. [H, 1] for a constant decay per head): float32 outputs
    [B, H, T, V] and state [B, H, K, V]."""


@dispatch_packed("lightning", like=naive_recurrent_lightning)
def lightning_attention_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay broadcastable to
    [1, H, T], sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1; initial_state [N, H, K, V] or None.
    Returns output [1, H, T, V] and final states [N, H, K, V], float32."""


__all__ = [
    "ScalarDecaySpan",
    "chunk_lightning",
    "fused_recurrent_lightning",
    "lightning_attention",
    "lightning_attention_varlen",
    "lightning_with_transition",
    "minimax_log_decay",
    "naive_recurrent_lightning",
    "select_lightning_backend",
]
