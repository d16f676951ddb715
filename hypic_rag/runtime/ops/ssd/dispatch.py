"""The one place that picks an SSD backend for a call, and packed variable-length sequences.

- CUDA tensors with flash-linear-attention (`ops/backends.py`): fla's simple-GLA kernels (`simple_gla.py` maps
  SSD onto them): the fused recurrent one for a few tokens, the chunked one otherwise; `cu_seqlens` for packed runs.
- Otherwise a few tokens (decode steps): the step-by-step recurrence (`recurrent.py`).
- Otherwise the chunked SSD in torch (`chunk.py`).
All backends share one contract: head-major inputs, float32 outputs [batch, H, T, P] and state [batch, H, N, P].
`ssd_varlen` takes sequences packed along time (`cu_seqlens`), each with its own start state: one fla call on CUDA,
one call per sequence elsewhere. For equal-shape batches of different lengths, right-pad with dt = 0 instead:
padded tokens leave the state as is.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.ssd.chunk import DEFAULT_CHUNK_SIZE, chunk_ssd
from hypic_rag.runtime.ops.ssd.recurrent import recurrent_ssd
from hypic_rag.runtime.ops.ssd.simple_gla import ssd_through_simple_gla
from hypic_rag.runtime.ops.varlen import each_sequence, fla_backend, offsets, packed_bounds

RECURRENT_MAX_TOKENS = 4
"""At or below this many tokens the step-by-step recurrence beats the chunked form (no padding to a chunk)."""

BACKENDS = ("fla", "fla_recurrent", "recurrent", "chunk")


def select_backend(x: torch.Tensor, longest: int | None = None) -> str:
    """One of `BACKENDS` for inputs shaped like `x` [batch, H, T, P] (`longest`: the longest packed sequence)."""
    few = (x.shape[2] if longest is None else longest) <= RECURRENT_MAX_TOKENS
    if x.shape[2] > 0 and backends.use_fla(x, "simple_gla"):
        return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


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
    backend = select_backend(x)
    if backend in ("fla", "fla_recurrent"):
        return ssd_through_simple_gla(x, dt, a, b, c, d, initial_state, recurrent=backend == "fla_recurrent")
    if backend == "recurrent":
        return recurrent_ssd(x, dt, a, b, c, d, initial_state)
    return chunk_ssd(x, dt, a, b, c, d, initial_state, chunk_size)


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
    _, heads, total, head_dim = x.shape
    bounds = packed_bounds(cu_seqlens, x, initial_state)
    backend = fla_backend(select_backend, x, bounds)
    if backend is not None:
        return ssd_through_simple_gla(x, dt, a, b, c, d, initial_state, recurrent=backend == "fla_recurrent",
                                      cu_seqlens=offsets(bounds, x.device))
    def run_one(x_part: torch.Tensor, dt_part: torch.Tensor, b_part: torch.Tensor, c_part: torch.Tensor,
                start: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # a and d are not per time step
        return ssd(x_part, dt_part, a, b_part, c_part, d, start)

    return each_sequence(run_one, (x, dt, b, c), bounds, initial_state, (1, heads, total, head_dim),
                         (heads, b.shape[-1], head_dim))
