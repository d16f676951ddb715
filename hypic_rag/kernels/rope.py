"""Cached pre-RoPE keys rotated at their true positions, written straight into the attention K buffer.

A cached chunk's keys were stored before RoPE (docs/design.md); at assembly they are rotated for the positions the
chunk really occupies. `rope_into` reads the keys in their storage dtype, rotates the first R dims in float32 with
the half-split convention of `hypic_rag.runtime.ops.rope.apply_rotary` (x * cos + rotate_half(x) * sin, where
rotate_half(x) = [-x[R/2:], x[:R/2]]), copies the other D - R dims through (partial rotary), and stores the result
in the buffer's dtype at its token offset: no rotated copy, no concatenation, no dtype-cast pass.

The cos / sin tables [P, R] are whatever the model's own rotary module computed for positions 0..P-1
(`layers.rotary_tables`), so multimodal RoPE sections (Qwen3.5's interleaved M-RoPE) and scaled RoPE variants are
covered without the kernel knowing about them. The float32 reference is
`hypic_rag.runtime.ops.rope.naive_rope_into`; the runtime reaches this module only through `hypic_rag.runtime.ops.rope`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(out: torch.Tensor, out_start: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_start: int) -> None:
    heads, length, dim = keys.shape
    rotary = cos.shape[-1]
    if out.dim() != 3 or out.shape[0] != heads or out.shape[2] != dim:
        raise ValueError(f"buffer {tuple(out.shape)} does not hold keys {tuple(keys.shape)}")
    if not 0 <= out_start <= out.shape[1] - length:
        raise ValueError(f"{length} keys at offset {out_start} do not fit a buffer of {out.shape[1]} tokens")
    if cos.shape != sin.shape or cos.dim() != 2 or rotary % 2 or rotary > dim:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [positions, even R <= {dim}]")
    if not 0 <= position_start <= cos.shape[0] - length:
        raise ValueError(f"positions {position_start}..{position_start + length - 1} outside the {cos.shape[0]}-row tables")


@triton.jit
def _rope_into_kernel(
    keys_ptr, cos_ptr, sin_ptr, out_ptr, tokens, position_start, out_start, stride_keys_h, stride_keys_t, stride_keys_d,
    stride_cos_t, stride_cos_d, stride_sin_t, stride_sin_d, stride_out_h, stride_out_t, stride_out_d,
    HALF: tl.constexpr, PASS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    head = tl.program_id(0)
    token = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = token < tokens
    position = position_start + token
    dims = tl.arange(0, BLOCK_HALF)
    ok = token_ok[:, None] & (dims < HALF)[None, :]
    source = keys_ptr + head * stride_keys_h + token[:, None] * stride_keys_t
    target = out_ptr + head * stride_out_h + (out_start + token)[:, None] * stride_out_t
    first = tl.load(source + dims[None, :] * stride_keys_d, mask=ok, other=0.0).to(tl.float32)
    second = tl.load(source + (dims + HALF)[None, :] * stride_keys_d, mask=ok, other=0.0).to(tl.float32)
    cos_row = cos_ptr + position[:, None] * stride_cos_t
    sin_row = sin_ptr + position[:, None] * stride_sin_t
    cos_first = tl.load(cos_row + dims[None, :] * stride_cos_d, mask=ok, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_row + (dims + HALF)[None, :] * stride_cos_d, mask=ok, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_row + dims[None, :] * stride_sin_d, mask=ok, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_row + (dims + HALF)[None, :] * stride_sin_d, mask=ok, other=0.0).to(tl.float32)
    out_first = first * cos_first - second * sin_first
    out_second = second * cos_second + first * sin_second
    tl.store(target + dims[None, :] * stride_out_d, out_first.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(target + (dims + HALF)[None, :] * stride_out_d, out_second.to(out_ptr.dtype.element_ty), mask=ok)
    if PASS > 0:
        rest = tl.arange(0, BLOCK_PASS)
        rest_ok = token_ok[:, None] & (rest < PASS)[None, :]
        passed = tl.load(source + (2 * HALF + rest)[None, :] * stride_keys_d, mask=rest_ok, other=0.0)
        tl.store(target + (2 * HALF + rest)[None, :] * stride_out_d, passed.to(out_ptr.dtype.element_ty), mask=rest_ok)


def rope_into(
    out: torch.Tensor, out_start: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_start: int
) -> torch.Tensor:
    """Write `keys` [H, L, D] (pre-RoPE, any float dtype and strides) rotated at positions position_start ..
    position_start + L - 1 into out[:, out_start : out_start + L] (out [H, N, D], its own dtype); cos / sin [P, R]
    are the rotary tables by position (R even, R <= D; dims R.. pass through). Returns `out`."""
    _check(out, out_start, keys, cos, sin, position_start)
    heads, length, dim = keys.shape
    if length == 0 or heads == 0:
        return out
    half = cos.shape[-1] // 2
    passed = dim - 2 * half
    block_t = 32
    _rope_into_kernel[(heads, triton.cdiv(length, block_t))](
        keys,
        cos,
        sin,
        out,
        length,
        position_start,
        out_start,
        *keys.stride(),
        *cos.stride(),
        *sin.stride(),
        *out.stride(),
        HALF=half,
        PASS=passed,
        BLOCK_HALF=max(triton.next_power_of_2(half), 1),
        BLOCK_PASS=max(triton.next_power_of_2(passed), 1),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return out
