"""RoPE in plain torch: the rotation itself (`apply_rotary`, the half-split convention the models use) and the
float32 reference of writing rotated cached keys into an attention K buffer (`naive_rope_into`), which the Triton
kernel (`hypic_rag.kernels.rope`) and the torch path of `rotate.rotate_into_torch` are tested against."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of x [H, T, D] (half-split convention); the rest pass through (partial rotary).

    cos, sin [T, R] (R even, R <= D): x * cos + rotate_half(x) * sin with rotate_half(x) = [-x[R/2:], x[:R/2]],
    computed in x's dtype. Returns [H, T, D]."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1)
    out = rotated * cos.to(x.dtype) + turned * sin.to(x.dtype)
    return torch.cat([out, passed], dim=-1)


def naive_rope_into(
    out: torch.Tensor, out_start: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_start: int
) -> torch.Tensor:
    """out[:, out_start : out_start + L] = keys [H, L, D] rotated at positions position_start .. + L - 1 (cos, sin
    [P, R] by position), in float32 arithmetic, stored in out's dtype. Returns `out` [H, N, D]."""
    length = keys.shape[1]
    rows = slice(position_start, position_start + length)
    rotated = apply_rotary(keys.float(), cos[rows].float(), sin[rows].float())
    out[:, out_start : out_start + length] = rotated.to(out.dtype)
    return out
