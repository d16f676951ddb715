"""The one place that picks a selective-scan (Mamba1) backend for a call, and packed variable-length sequences.

- CPU, or a few tokens anywhere: the step-by-step recurrence (`recurrent.py`). Measured on this 2-core CPU
  (noisy, shared machine): D=4096, N=16, T=512 takes 0.11 s step by step against 0.34 s for the blocked scan; the
  state [D, N] stays in cache and each step is four small ops.
- CUDA with more than a few tokens: the blocked log-depth scan (`scan.py`): T / C * log2(C) launches instead of
  ~4 T. (Not yet measured on a GPU: no device was available to this change.)
All backends share one contract: channel-major x, dt [batch, D, T], float32 outputs [batch, D, T], state [batch, D, N].
`selective_scan_varlen` runs sequences packed along time (`cu_seqlens`), each from its own start state.
"""

from __future__ import annotations

import itertools

import torch

from hypic_rag.runtime.ops.selective_scan.recurrent import recurrent_selective_scan
from hypic_rag.runtime.ops.selective_scan.scan import DEFAULT_BLOCK_SIZE, blocked_selective_scan
from hypic_rag.runtime.ops.varlen import check_cu_seqlens

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence is used on every device."""

BACKENDS = ("recurrent", "blocked")


def select_backend(x: torch.Tensor) -> str:
    """One of `BACKENDS` for inputs shaped like `x` [batch, D, T]."""
    return "blocked" if x.is_cuda and x.shape[2] > RECURRENT_MAX_TOKENS else "recurrent"


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan through the backend `select_backend` picks; contract of `naive_selective_scan`."""
    if select_backend(x) == "blocked":
        return blocked_selective_scan(x, dt, a, b, c, d, initial_state, block_size)
    return recurrent_selective_scan(x, dt, a, b, c, d, initial_state)


def selective_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences packed along time: x, dt [1, D, T], b, c [1, T, N], sequence s at T-indices
    cu_seqlens[s] .. cu_seqlens[s+1] - 1 (cu_seqlens [S + 1], 0 .. T, non-decreasing); initial_state [S, D, N] or
    None (zeros). Returns output [1, D, T] and final states [S, D, N], float32.
    """
    batch, channels, total = x.shape
    bounds = check_cu_seqlens(cu_seqlens, total, batch)
    sequences = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != sequences:
        raise ValueError(f"{initial_state.shape[0]} start states for {sequences} sequences")
    output = torch.zeros(1, channels, total, dtype=torch.float32, device=x.device)
    finals = []
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        start = None if initial_state is None else initial_state[number : number + 1]
        piece_output, final = selective_scan(
            x[:, :, begin:end], dt[:, :, begin:end], a, b[:, begin:end], c[:, begin:end], d, start
        )
        output[:, :, begin:end] = piece_output
        finals.append(final)
    if not finals:
        return output, torch.zeros(0, channels, a.shape[1], dtype=torch.float32, device=x.device)
    return output, torch.cat(finals)
