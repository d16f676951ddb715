"""Mamba2 / SSD (state-space duality): S_t = exp(dt_t a_h) S_{t-1} + dt_t b_t x_t^T, y_t = S_t^T c_t + d_h x_t.

Used by transformers' bamba, granitemoehybrid, nemotron_h, falcon_h1 and zamba2 mixers (docs/families_ssm.md).
Layout: inputs head-major, x [batch, H, T, P], dt [batch, H, T], b and c [batch, G, T, N] shared by H / G heads;
the state per head is [N, P] (fla's [K, V] layout: b plays the key, c the query, x the value), i.e. transformers'
[batch, H, P, N] cache entry transposed. `naive.py` is the token-by-token float32 reference, `chunk.py` the chunked
torch implementation, `recurrent.py` the step path for decode, `simple_gla.py` SSD through fla's simple-GLA kernels,
`transition.py` returns a span's affine map (P a scalar per head). `ssd` and `ssd_varlen` run the backend
`ops/registry.py` picks. dt comes from `ops.time_step.softplus_time_step`.
"""

from typing import Any

import torch

from hypic_rag.runtime.ops.registry import dispatch, dispatch_packed, select
from hypic_rag.runtime.ops.ssd.chunk import chunk_ssd
from hypic_rag.runtime.ops.ssd.naive import expand_groups, naive_ssd
from hypic_rag.runtime.ops.ssd.recurrent import recurrent_ssd
from hypic_rag.runtime.ops.ssd.transition import apply_ssd_transition, compose_ssd_transitions, ssd_with_transition


def select_backend(x: torch.Tensor, longest: int | None = None) -> str:
    """The backend for inputs shaped like `x` [batch, H, T, P] (`longest`: the longest packed sequence)."""
    return select("ssd", x, longest)


@dispatch("ssd", like=chunk_ssd)
def ssd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD through the backend the registry picks; contract of `naive_ssd` / `chunk_ssd`: float32 outputs
    [batch, H, T, P] and state [batch, H, N, P]."""


@dispatch_packed("ssd", like=naive_ssd)
def ssd_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences packed along time: x [1, H, T, P], dt [1, H, T], b, c [1, G, T, N], sequence n at T-indices
    cu_seqlens[n] .. cu_seqlens[n+1] - 1 (cu_seqlens [S + 1], 0 .. T, non-decreasing); initial_state [S, H, N, P]
    or None (zeros). Returns output [1, H, T, P] and final states [S, H, N, P], float32. For equal-shape batches of
    different lengths, right-pad with dt = 0 instead: padded tokens leave the state as is.
    """


__all__ = [
    "apply_ssd_transition",
    "chunk_ssd",
    "compose_ssd_transitions",
    "expand_groups",
    "naive_ssd",
    "recurrent_ssd",
    "select_backend",
    "ssd",
    "ssd_varlen",
    "ssd_with_transition",
]
