"""Mamba1 selective scan (jamba): S_t = exp(dt_t[d] a[d, n]) S_{t-1} + dt_t[d] x_t[d] b_t[n], y_t = S_t c_t + d x_t.

Every channel d decays every state entry n at its own rate, so a span's transition is ELEMENTWISE, shaped like the
state [D, N]. Layout follows mamba_ssm / transformers: channel-major x and dt [batch, D, T], a [D, N], b and c
[batch, T, N] shared by all channels, state [batch, D, N] (transformers' cache layout). `naive.py` is the
token-by-token float32 reference, `scan.py` the blocked log-depth scan (CUDA, more than a few tokens),
`recurrent.py` the step path (decode, and every length on CPU where it is fastest: docs/families_ssm.md),
`transition.py` returns a span's affine map. `selective_scan` and `selective_scan_varlen` run the backend
`ops/registry.py` picks. dt comes from `ops.time_step.softplus_time_step` (no clamp for jamba).
"""

from typing import Any

import torch

from hypic_rag.runtime.ops.registry import dispatch, dispatch_packed, select
from hypic_rag.runtime.ops.selective_scan.naive import naive_selective_scan
from hypic_rag.runtime.ops.selective_scan.recurrent import recurrent_selective_scan
from hypic_rag.runtime.ops.selective_scan.scan import blocked_selective_scan
from hypic_rag.runtime.ops.selective_scan.transition import (
    apply_selective_scan_transition,
    compose_selective_scan_transitions,
    selective_scan_start_output,
    selective_scan_with_transition,
)


def select_backend(x: torch.Tensor) -> str:
    """The backend for inputs shaped like `x` [batch, D, T]."""
    return select("selective_scan", x)


@dispatch("selective_scan", like=blocked_selective_scan)
def selective_scan(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan through the backend the registry picks; contract of `naive_selective_scan`: channel-major
    x, dt [batch, D, T], float32 outputs [batch, D, T], state [batch, D, N]."""


@dispatch_packed("selective_scan", like=naive_selective_scan)
def selective_scan_varlen(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences packed along time: x, dt [1, D, T], b, c [1, T, N], sequence s at T-indices
    cu_seqlens[s] .. cu_seqlens[s+1] - 1 (cu_seqlens [S + 1], 0 .. T, non-decreasing); initial_state [S, D, N] or
    None (zeros). Returns output [1, D, T] and final states [S, D, N], float32.
    """


__all__ = [
    "apply_selective_scan_transition",
    "blocked_selective_scan",
    "compose_selective_scan_transitions",
    "naive_selective_scan",
    "recurrent_selective_scan",
    "select_backend",
    "selective_scan",
    "selective_scan_start_output",
    "selective_scan_varlen",
    "selective_scan_with_transition",
]
