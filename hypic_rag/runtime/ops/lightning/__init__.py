"""Linear attention with a scalar decay per head (MiniMax lightning attention; also simple GLA / Mamba2-style
per-token scalar decays):

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = S_t^T q_t

MiniMax uses a constant g = -slope_h per head (pass log_decay shaped [H, 1]). Layout follows fla: state S per head is
[K, V]; inputs are head-major [B, H, T, D]. `naive.py` is the token-by-token float32 reference, `chunk.py` the
chunked (block) form, `recurrent.py` the step path for decode, `transition.py` the span's scalar transition
(`ScalarDecaySpan`), `dispatch.py` picks the backend (fla's
simple-GLA kernels on CUDA) and runs packed sequences, `slopes.py`
MiniMax's per-head decays.
"""

from hypic_rag.runtime.ops.lightning.chunk import chunk_lightning
from hypic_rag.runtime.ops.lightning.dispatch import (
    lightning_attention,
    lightning_attention_varlen,
    select_lightning_backend,
)
from hypic_rag.runtime.ops.lightning.naive import naive_recurrent_lightning
from hypic_rag.runtime.ops.lightning.recurrent import fused_recurrent_lightning
from hypic_rag.runtime.ops.lightning.slopes import minimax_log_decay
from hypic_rag.runtime.ops.lightning.transition import (
    ScalarDecaySpan,
    lightning_with_transition,
)

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
