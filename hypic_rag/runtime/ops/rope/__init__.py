"""Rotary position embedding for cached keys re-positioned at assembly (docs/design.md, section 3).

`naive.py` holds the rotation (`apply_rotary`) and the float32 reference of rotating keys into the K buffer;
`rotate.py` the Triton (`hypic_rag.kernels.rope.rope_into`) and torch paths; `rotate_into` runs the one
`ops/registry.py` picks.
"""

import torch

from hypic_rag.runtime.ops.registry import dispatch
from hypic_rag.runtime.ops.rope.naive import apply_rotary, naive_rope_into


@dispatch("rotate_into")
def rotate_into(
    buffer: torch.Tensor, at: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position: int, *,
    backend: str | None = None,
) -> None:
    """buffer[:, at : at + L] = pre-RoPE keys [H, L, D] rotated at positions position .. position + L - 1 (cos, sin
    [P, R] by position); buffer [H, N, D]. `backend` ("triton" / "torch") overrides the switch."""


__all__ = ["apply_rotary", "naive_rope_into", "rotate_into"]
