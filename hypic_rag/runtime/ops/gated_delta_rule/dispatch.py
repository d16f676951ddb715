"""The one place that picks a gated-delta-rule backend for a call.

- CUDA tensors with flash-linear-attention installed (and HYPIC_RAG_KERNELS != "torch"): fla's fused recurrent
  kernel for a few tokens (decode), its chunked kernel otherwise (`hypic_rag.kernels.gated_delta_rule`).
- Otherwise a few tokens (decode steps): the step-by-step recurrence (`recurrent.py`).
- Otherwise the chunked WY implementation in torch (`chunk.py`).
All backends share one contract: head-major [B, H, T, D] inputs, float32 outputs [B, H, T, V] and state [B, H, K, V].
`gated_delta_rule_varlen` takes sequences packed along time (`cu_seqlens`), each with its own start state: fla's
varlen kernels on CUDA, one call per sequence elsewhere.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.gated_delta_rule.chunk import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import fused_recurrent_gated_delta_rule
import itertools

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("fla", "fla_recurrent", "recurrent", "chunk")


def select_backend(query: torch.Tensor) -> str:
    """One of `BACKENDS` for inputs shaped like `query` [B, H, T, K]."""
    length = query.shape[2]
    few = length <= RECURRENT_MAX_TOKENS
    if query.is_cuda and length > 0:
        from hypic_rag.kernels.gated_delta_rule import fla_available

        if fla_available():
            return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule through the backend `select_backend` picks; contract of `chunk_gated_delta_rule`."""
    backend = select_backend(query)
    if backend == "fla":
        from hypic_rag.kernels.gated_delta_rule import fla_chunk_gated_delta_rule

        return fla_chunk_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    if backend == "fla_recurrent":
        from hypic_rag.kernels.gated_delta_rule import fla_fused_recurrent_gated_delta_rule

        return fla_fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    if backend == "recurrent":
        return fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, initial_state)
    return chunk_gated_delta_rule(query, key, value, log_decay, beta, initial_state, chunk_size)


def gated_delta_rule_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """N sequences packed along time: query, key [1, H, T, K], value [1, H, T, V], log_decay, beta [1, H, T] with
    sequence n at T-indices cu_seqlens[n] .. cu_seqlens[n+1] - 1 (cu_seqlens [N + 1], 0 .. T, non-decreasing);
    initial_state [N, H, K, V] or None (zeros). Returns output [1, H, T, V] and final states [N, H, K, V], float32.
    """
    bounds = [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    total = query.shape[2]
    if query.shape[0] != 1 or not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens {bounds} must run from 0 to the {total} packed tokens of a batch of one")
    if any(b > a for b, a in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens {bounds} must be non-decreasing")
    sequences = len(bounds) - 1
    heads, key_dim, value_dim = key.shape[1], key.shape[-1], value.shape[-1]
    if initial_state is not None and initial_state.shape[0] != sequences:
        raise ValueError(f"{initial_state.shape[0]} start states for {sequences} sequences")
    if query.is_cuda and total > 0 and all(b > a for a, b in itertools.pairwise(bounds)):
        from hypic_rag.kernels.gated_delta_rule import (
            fla_available,
            fla_chunk_gated_delta_rule,
            fla_fused_recurrent_gated_delta_rule,
        )

        if fla_available():
            longest = max(b - a for a, b in itertools.pairwise(bounds))
            run = fla_fused_recurrent_gated_delta_rule if longest <= RECURRENT_MAX_TOKENS else fla_chunk_gated_delta_rule
            offsets = torch.tensor(bounds, dtype=torch.long, device=query.device)
            return run(query, key, value, log_decay, beta, initial_state, offsets)
    output = torch.zeros(1, heads, total, value_dim, dtype=torch.float32, device=value.device)
    finals = []
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        start = None if initial_state is None else initial_state[number : number + 1]
        if end == begin:
            finals.append(
                torch.zeros(1, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
                if start is None
                else start.float().clone()
            )
            continue
        piece = (x[:, :, begin:end] for x in (query, key, value, log_decay, beta))
        output[:, :, begin:end], final = gated_delta_rule(*piece, start)
        finals.append(final)
    final_states = (
        torch.cat(finals) if finals else torch.zeros(0, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    )
    return output, final_states
