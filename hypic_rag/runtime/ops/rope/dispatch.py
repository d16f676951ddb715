"""The one place that picks how cached pre-RoPE keys are rotated into the attention K buffer.

- "triton": `hypic_rag.kernels.rope.rope_into` reads the keys in their storage dtype, rotates in float32 and writes
  the buffer's dtype at its offset (no rotated copy, no cast pass);
- "torch": the keys cast to the buffer's dtype and rotated by `apply_rotary` in that dtype.
`backends.py` says which may run; `naive.py` holds the float32 reference both are tested against.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.ops.rope.naive import apply_rotary


def rotate_into(
    buffer: torch.Tensor,
    at: int,
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position: int,
    *,
    backend: str | None = None,
) -> None:
    """buffer[:, at : at + L] = pre-RoPE keys [H, L, D] rotated at positions position .. position + L - 1 (cos, sin
    [P, R] by position); buffer [H, N, D]. `backend` ("triton" / "torch") overrides the switch."""
    if backends.resolve(backend, buffer) == "triton":
        from hypic_rag.kernels.rope import rope_into

        rope_into(buffer, at, keys.to(buffer.device), cos, sin, position)
        return
    length = keys.shape[1]
    keys = keys.to(device=buffer.device, dtype=buffer.dtype)
    buffer[:, at : at + length] = apply_rotary(keys, cos[position : position + length], sin[position : position + length])
