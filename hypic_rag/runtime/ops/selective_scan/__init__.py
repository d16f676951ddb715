"""Mamba1 selective scan (jamba): S_t = exp(dt_t[d] a[d, n]) S_{t-1} + dt_t[d] x_t[d] b_t[n], y_t = S_t c_t + d x_t.

Every channel d decays every state entry n at its own rate, so a span's transition is ELEMENTWISE, shaped like the
state [D, N]. Layout follows mamba_ssm / transformers: channel-major x and dt [batch, D, T], a [D, N], b and c
[batch, T, N] shared by all channels, state [batch, D, N] (transformers' cache layout). `naive.py` is the
token-by-token float32 reference, `scan.py` the blocked log-depth scan, `recurrent.py` the step path (decode, and
every length on CPU where it is fastest), `dispatch.py` picks one and runs packed sequences, `transition.py` returns
a span's affine map. dt comes from `ops.time_step.softplus_time_step` (no clamp for jamba).
"""

from hypic_rag.runtime.ops.selective_scan.dispatch import select_backend, selective_scan, selective_scan_varlen
from hypic_rag.runtime.ops.selective_scan.naive import naive_selective_scan
from hypic_rag.runtime.ops.selective_scan.recurrent import recurrent_selective_scan
from hypic_rag.runtime.ops.selective_scan.scan import blocked_selective_scan
from hypic_rag.runtime.ops.selective_scan.transition import (
    apply_selective_scan_transition,
    compose_selective_scan_transitions,
    selective_scan_start_output,
    selective_scan_with_transition,
)

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
