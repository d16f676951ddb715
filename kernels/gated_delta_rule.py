"""The gated delta rule on CUDA through flash-linear-attention's chunked Triton kernel.

Same contract as `hypic_rag.runtime.ops.gated_delta_rule.chunk_gated_delta_rule` (head-major [B, H, T, D] inputs,
query already l2-normalised and scaled, float32 outputs and state); the runtime dispatches here for CUDA tensors
when fla is installed, unless HYPIC_RAG_KERNELS=torch. The identity-start trick (transition operator) works
unchanged: it only widens the value dimension.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def fla_available() -> bool:
    """True when CUDA is present, fla imports, and HYPIC_RAG_KERNELS is not "torch"."""
    if os.environ.get("HYPIC_RAG_KERNELS", "auto") == "torch" or not torch.cuda.is_available():
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def fla_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [B, H, T, K]; value [B, H, T, V]; log_decay, beta [B, H, T]; initial_state [B, H, K, V] or None.
    Returns output [B, H, T, V] and final state [B, H, K, V], float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    def time_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).contiguous()

    output, final_state = fla_chunk(
        time_major(query),
        time_major(key),
        time_major(value),
        g=time_major(log_decay).float(),
        beta=time_major(beta),
        scale=1.0,  # the runtime scales the query itself
        initial_state=None if initial_state is None else initial_state.float().contiguous(),
        output_final_state=True,
    )
    return output.transpose(1, 2).float(), final_state.float()
