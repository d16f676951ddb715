"""What every flash-linear-attention (fla) wrapper shares: whether an fla op imports, and the layout change.

The wrappers (`gated_delta_rule.py`, `kda.py`, `simple_gla.py`) keep the runtime's contract (head-major
[B, H, T, D] inputs, float32 outputs [B, H, T, V] and states [N, H, K, V], query already scaled) and call fla
(written against flash-linear-attention / fla-core 0.6.0, what scripts/gpu_check.sh carries): time-major
[B, T, H, D] inputs, `scale=1.0`, float32 `initial_state`, `output_final_state=True`, and `cu_seqlens` [N + 1]
int64 for sequences packed along time in a batch of one, each with its own start and final state.
`hypic_rag.runtime.ops.backends.use_fla` is the one switch that decides whether fla runs a call.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

logger = logging.getLogger(__name__)

FLA_MODULES = {
    "gated_delta_rule": "fla.ops.gated_delta_rule",
    "kda": "fla.ops.kda",
    "simple_gla": "fla.ops.simple_gla",
}
"""The fla op modules the runtime calls, by the name the ops registry uses."""


@functools.cache
def fla_importable(op: str) -> bool:
    """Whether fla's `op` (a key of FLA_MODULES) imports (imported at most once; a broken install is logged once
    and the torch path used)."""
    try:
        importlib.import_module(FLA_MODULES[op])
    except ImportError:
        return False
    except Exception as error:  # fla imports transformers and registers models: anything may go wrong there
        logger.warning("flash-linear-attention is installed but %s does not import (%s: %s); using the torch path",
                       FLA_MODULES[op], type(error).__name__, error)
        return False
    return True


def time_major(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, ...] -> [B, T, H, ...], contiguous (fla's layout)."""
    return x.transpose(1, 2).contiguous()


def head_major_float(x: torch.Tensor) -> torch.Tensor:
    """fla's output [B, T, H, V] -> the runtime's [B, H, T, V] float32."""
    return x.transpose(1, 2).float()


def start_state(initial_state: torch.Tensor | None) -> torch.Tensor | None:
    """The start states as fla takes them: float32, contiguous (None: zeros)."""
    return None if initial_state is None else initial_state.float().contiguous()


def check_varlen(query: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None) -> None:
    """Packed sequences come as a batch of one with one start state per sequence."""
    if cu_seqlens is None:
        return
    if query.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in a batch of one, got batch {query.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != cu_seqlens.numel() - 1:
        raise ValueError(f"{initial_state.shape[0]} start states for {cu_seqlens.numel() - 1} sequences")


def run_fla(
    function, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call fla's `function` (a chunked or fused-recurrent op) with the runtime's head-major tensors: q, k, v, the
    log decay g and (for the delta rules) beta made time-major, `scale=1.0` (the runtime scales the query itself),
    float32 start states, the final states asked for. Returns output [B, H, T, V] and final states, float32."""
    check_varlen(query, cu_seqlens, initial_state)
    extra = {} if beta is None else {"beta": time_major(beta)}
    output, final_state = function(
        q=time_major(query),
        k=time_major(key),
        v=time_major(value),
        g=time_major(log_decay).float(),
        scale=1.0,
        initial_state=start_state(initial_state),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
        **extra,
    )
    return head_major_float(output), final_state.float()
