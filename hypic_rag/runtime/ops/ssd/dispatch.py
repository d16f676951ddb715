"""The one place that picks an SSD backend for a call, and packed variable-length sequences.

- A few tokens (decode steps): the step-by-step recurrence (`recurrent.py`).
- Otherwise the chunked SSD in torch (`chunk.py`).
(There is no fused-kernel backend: mamba_ssm is not a dependency; the torch paths run on CPU and CUDA alike.)
All backends share one contract: head-major inputs, float32 outputs [batch, H, T, P] and state [batch, H, N, P].
`ssd_varlen` takes sequences packed along time (`cu_seqlens`), each with its own start state, one call per sequence.
For equal-shape batches of different lengths, right-pad with dt = 0 instead: padded tokens leave the state as is.
"""

from __future__ import annotations

import itertools

import torch

from hypic_rag.runtime.ops.ssd.chunk import DEFAULT_CHUNK_SIZE, chunk_ssd
from hypic_rag.runtime.ops.ssd.recurrent import recurrent_ssd

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("recurrent", "chunk")


def select_backend(x: torch.Tensor) -> str:
    """One of `BACKENDS` for inputs shaped like `x` [batch, H, T, P]."""
    return "recurrent" if x.shape[2] <= RECURRENT_MAX_TOKENS else "chunk"


def ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD through the backend `select_backend` picks; contract of `naive_ssd` / `chunk_ssd`."""
    if select_backend(x) == "recurrent":
        return recurrent_ssd(x, dt, a, b, c, d, initial_state)
    return chunk_ssd(x, dt, a, b, c, d, initial_state, chunk_size)


def check_cu_seqlens(cu_seqlens: list[int] | torch.Tensor, total: int, batch: int) -> list[int]:
    """The sequence bounds as ints: 0 .. total, non-decreasing, for a batch of one packed row."""
    bounds = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]
    if batch != 1 or not bounds or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens {bounds} must run from 0 to the {total} packed tokens of a batch of one")
    if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens {bounds} must be non-decreasing")
    return bounds


def ssd_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: list[int] | torch.Tensor,
    d: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences packed along time: x [1, H, T, P], dt [1, H, T], b, c [1, G, T, N], sequence n at T-indices
    cu_seqlens[n] .. cu_seqlens[n+1] - 1 (cu_seqlens [S + 1], 0 .. T, non-decreasing); initial_state [S, H, N, P]
    or None (zeros). Returns output [1, H, T, P] and final states [S, H, N, P], float32.
    """
    batch, heads, total, head_dim = x.shape
    bounds = check_cu_seqlens(cu_seqlens, total, batch)
    sequences, state_size = len(bounds) - 1, b.shape[-1]
    if initial_state is not None and initial_state.shape[0] != sequences:
        raise ValueError(f"{initial_state.shape[0]} start states for {sequences} sequences")
    output = torch.zeros(1, heads, total, head_dim, dtype=torch.float32, device=x.device)
    finals = []
    for number, (begin, end) in enumerate(itertools.pairwise(bounds)):
        start = None if initial_state is None else initial_state[number : number + 1]
        piece_output, final = ssd(
            x[:, :, begin:end], dt[:, :, begin:end], a, b[:, :, begin:end], c[:, :, begin:end], d, start
        )
        output[:, :, begin:end] = piece_output
        finals.append(final)
    if not finals:
        return output, torch.zeros(0, heads, state_size, head_dim, dtype=torch.float32, device=x.device)
    return output, torch.cat(finals)
