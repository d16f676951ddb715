"""The backends of rotating cached pre-RoPE keys into the attention K buffer, as `ops/registry.py` calls them.

- "triton": `hypic_rag.kernels.rope.rope_into` reads the keys in their storage dtype, rotates in float32 and writes
  the buffer's dtype at its offset (no rotated copy, no cast pass);
- "torch": the keys cast to the buffer's dtype and rotated by `apply_rotary` in that dtype.
`naive.py` holds the float32 reference both are tested against.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.ops.rope.naive import apply_rotary, naive_rope_into


def rotate_into_triton(
    buffer: torch.Tensor, at: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int
) -> None:
    """buffer [H, N, D][:, at : at + L] = keys [H, L, D] rotated at positions position .. position + L - 1."""
    from hypic_rag.kernels.rope import rope_into

    rope_into(buffer, at, keys.to(buffer.device), cos, sin, position)


def rotate_into_torch(
    buffer: torch.Tensor, at: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int
) -> None:
    """Same as `rotate_into_triton`, rotated in torch in the buffer's dtype."""
    length = keys.shape[1]
    keys = keys.to(device=buffer.device, dtype=buffer.dtype)
    buffer[:, at : at + length] = apply_rotary(keys, cos[position : position + length], sin[position : position + length])


def naive_rotate_into(
    buffer: torch.Tensor, at: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int
) -> None:
    """The float32 reference (`naive_rope_into`) under the dispatch's argument names."""
    naive_rope_into(buffer, at, keys.to(buffer.device), cos, sin, position)
