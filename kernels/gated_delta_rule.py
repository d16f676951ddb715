"""The gated delta rule on CUDA through flash-linear-attention (fla): chunked, fused-recurrent and varlen.

Same contract as `hypic_rag.runtime.ops.gated_delta_rule.chunk_gated_delta_rule` (head-major [B, H, T, D] inputs,
query already l2-normalised and scaled, float32 outputs and state); the runtime dispatches here for CUDA tensors
when fla is installed, unless HYPIC_RAG_KERNELS=torch (`dispatch.py`):
- `fla_chunk_gated_delta_rule`: encoding, seams with a start state, and the identity-start transition operator
  (that trick only widens the value dimension to V + K);
- `fla_fused_recurrent_gated_delta_rule`: decode steps (a few tokens, no chunk padding);
- `cu_seqlens` (both): variable-length sequences packed along time in a batch of one, each with its own start
  state and its own final state (batched seams and requests without padding).
fla's API (fla >= 0.3; checked against 0.6.0): inputs time-major [B, T, H, D], `g` the log decay, `scale` applied to
the query inside, `initial_state` / final state [N, H, K, V] float32.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _fla_importable() -> bool:
    """Whether fla's gated-delta-rule kernels import (a broken install is logged once and the torch path used)."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    except Exception as error:  # fla imports transformers and registers models: anything may go wrong there
        logger.warning("flash-linear-attention is installed but does not import (%s: %s); using the torch path",
                       type(error).__name__, error)
        return False
    return True


def fla_available() -> bool:
    """True when CUDA is present, fla imports, and HYPIC_RAG_KERNELS is not "torch" (read at every call)."""
    from hypic_rag.kernels import kernel_mode

    return kernel_mode() != "torch" and torch.cuda.is_available() and _fla_importable()


def _time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous()


def _check_varlen(query: torch.Tensor, cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None) -> None:
    if cu_seqlens is None:
        return
    if query.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in a batch of one, got batch {query.shape[0]}")
    if initial_state is not None and initial_state.shape[0] != cu_seqlens.numel() - 1:
        raise ValueError(f"{initial_state.shape[0]} start states for {cu_seqlens.numel() - 1} sequences")


def fla_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay, beta [B, H, T]; initial_state [N, H, K, V] or None;
    cu_seqlens [N + 1] int64 (B = 1, sequences packed along T) or None (N = B).
    Returns output [B, H, T, V] and final states [N, H, K, V], float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    _check_varlen(query, cu_seqlens, initial_state)
    output, final_state = fla_chunk(
        q=_time_major(query),
        k=_time_major(key),
        v=_time_major(value),
        g=_time_major(log_decay).float(),
        beta=_time_major(beta),
        scale=1.0,  # the runtime scales the query itself
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    return output.transpose(1, 2).float(), final_state.float()


def fla_fused_recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's token-by-token kernel (decode: one program per head and value block walks the tokens with the state in
    registers). Same contract as `fla_chunk_gated_delta_rule`."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    _check_varlen(query, cu_seqlens, initial_state)
    output, final_state = fla_recurrent(
        q=_time_major(query),
        k=_time_major(key),
        v=_time_major(value),
        g=_time_major(log_decay).float(),
        beta=_time_major(beta),
        scale=1.0,
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    return output.transpose(1, 2).float(), final_state.float()
