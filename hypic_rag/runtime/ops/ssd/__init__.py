"""Mamba2 / SSD (state-space duality): S_t = exp(dt_t a_h) S_{t-1} + dt_t b_t x_t^T, y_t = S_t^T c_t + d_h x_t.

Used by transformers' bamba, granitemoehybrid, nemotron_h, falcon_h1 and zamba2 mixers (docs/families_ssm.md).
Layout: inputs head-major, x [batch, H, T, P], dt [batch, H, T], b and c [batch, G, T, N] shared by H / G heads;
the state per head is [N, P] (fla's [K, V] layout: b plays the key, c the query, x the value), i.e. transformers'
[batch, H, P, N] cache entry transposed. `naive.py` is the token-by-token float32 reference, `chunk.py` the chunked
torch implementation, `recurrent.py` the step path for decode, `dispatch.py` picks one and runs packed sequences,
`transition.py` returns a span's affine map (P a scalar per head). dt comes from `ops.time_step.softplus_time_step`.
"""

from hypic_rag.runtime.ops.ssd.chunk import chunk_ssd
from hypic_rag.runtime.ops.ssd.dispatch import select_backend, ssd, ssd_varlen
from hypic_rag.runtime.ops.ssd.naive import expand_groups, naive_ssd
from hypic_rag.runtime.ops.ssd.recurrent import recurrent_ssd
from hypic_rag.runtime.ops.ssd.transition import apply_ssd_transition, compose_ssd_transitions, ssd_with_transition

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
