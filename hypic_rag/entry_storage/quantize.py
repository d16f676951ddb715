"""Group quantization of a tensor along its last dimension, each group with its own bfloat16 scale.

A tensor x [..., D] is cut into groups of `group` values along its last dimension (D = n_groups * group,
`group` a multiple of 8). Per group g:

- integers of `bits` bits (2..8): scale s_g = absmax(x_g) / qmax rounded *up* to bfloat16 (so no value clips),
  qmax = 2^(bits-1) - 1; codes q = round(x / s_g) in [-qmax, qmax]; decoded x_hat = q * s_g, so
  |x - x_hat| <= s_g / 2 for every value. Codes of fewer than 8 bits are stored biased (q + 2^(bits-1), in
  [1, 2^bits - 1]) and packed: every 8 codes fill `bits` bytes (little-endian bit order).
- float8 e4m3: s_g = absmax(x_g) / 448 rounded up to bfloat16, y = x / s_g stored as float8_e4m3fn (its bytes, as
  uint8), x_hat = float(y) * s_g: relative error <= 2^-4 for |y| >= 2^-6, absolute <= 2^-10 s_g below.

Stored shapes: codes [..., n_groups, group * bits / 8] (uint8; int8 [..., n_groups, group] for 8 bits), scales
[..., n_groups] (bfloat16). The group size is therefore readable from the shapes: decoding needs only the bits.
`naive.py` holds the same maths one value at a time.
"""

from __future__ import annotations

import torch

FLOAT8_MAX = 448.0
"""Largest finite float8 e4m3fn value."""
MIN_BITS, MAX_BITS = 2, 8
_BF16_ROUND_UP = 0xFFFF


def float8_supported() -> bool:
    """Whether this torch has the float8 e4m3fn dtype (torch >= 2.1)."""
    return hasattr(torch, "float8_e4m3fn")


def group_size(last_dim: int, max_group: int) -> int | None:
    """The largest multiple of 8 that divides `last_dim` and is at most `max_group`; None when there is none
    (a last dimension that is not a multiple of 8: such a tensor is not grouped)."""
    for size in range(min(max_group, last_dim) // 8 * 8, 0, -8):
        if last_dim % size == 0:
            return size
    return None


def ceil_to_bfloat16(values: torch.Tensor) -> torch.Tensor:
    """Non-negative finite float32 `values` rounded up to the next bfloat16 (exact values stay): bfloat16 is the top
    half of a float32's bits, so adding 0xFFFF to the bits and keeping the top half rounds up."""
    bits = values.float().contiguous().view(torch.int32)
    return ((bits + _BF16_ROUND_UP) >> 16).to(torch.int16).view(torch.bfloat16)


def _grouped(tensor: torch.Tensor, group: int) -> torch.Tensor:
    last = tensor.shape[-1]
    if group % 8 or last % group:
        raise ValueError(f"a group of {group} values does not divide a last dimension of {last} in multiples of 8")
    return tensor.float().reshape(*tensor.shape[:-1], last // group, group)


def _scales(grouped: torch.Tensor, largest_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(bfloat16 scales [..., n_groups], float32 divisors [..., n_groups, 1]; 1 for an all-zero group)."""
    scale = ceil_to_bfloat16(grouped.abs().amax(dim=-1) / largest_code)
    divisor = scale.float()
    divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    return scale, divisor.unsqueeze(-1)


def quantize_int(tensor: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `tensor` [..., D] as `bits`-bit integer groups of `group` values (see the module)."""
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"integer codes have {MIN_BITS} to {MAX_BITS} bits, got {bits}")
    grouped = _grouped(tensor, group)
    largest = 2 ** (bits - 1) - 1
    scale, divisor = _scales(grouped, largest)
    codes = torch.round(grouped / divisor).clamp_(-largest, largest)
    if bits == 8:
        return codes.to(torch.int8), scale
    return pack_codes((codes + 2 ** (bits - 1)).to(torch.uint8), bits), scale


def dequantize_int(codes: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., D] that `quantize_int` codes stand for, in `dtype` (computed where `codes` lie)."""
    if bits == 8:
        values = codes.float()
    else:
        values = unpack_codes(codes, bits).float() - 2 ** (bits - 1)
    values = values * scale.float().unsqueeze(-1)
    return values.reshape(*values.shape[:-2], -1).to(dtype)


def quantize_float8(tensor: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 e4m3fn codes as uint8 [..., n_groups, group], scales) of `tensor` [..., D] (see the module)."""
    if not float8_supported():
        raise ValueError("this torch has no float8_e4m3fn dtype (torch >= 2.1 has it)")
    grouped = _grouped(tensor, group)
    scale, divisor = _scales(grouped, FLOAT8_MAX)
    codes = (grouped / divisor).clamp_(-FLOAT8_MAX, FLOAT8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale


def dequantize_float8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., D] that `quantize_float8` codes stand for, in `dtype`."""
    values = codes.contiguous().view(torch.float8_e4m3fn).float() * scale.float().unsqueeze(-1)
    return values.reshape(*values.shape[:-2], -1).to(dtype)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., m] below 2^bits (m a multiple of 8) packed into [..., m * bits / 8] bytes: each run of 8
    codes becomes one integer (code i at bit bits * i), written out as `bits` little-endian bytes."""
    if codes.shape[-1] % 8:
        raise ValueError(f"packing needs a multiple of 8 codes per row, got {codes.shape[-1]}")
    if bits == 8:
        return codes
    if bits == 4:  # two codes per byte: the common case without the 64-bit detour
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    runs = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    words = (runs << shifts).sum(dim=-1, keepdim=True)  # [..., m / 8, 1], at most 64 bits
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    packed = ((words >> byte_shifts) & 0xFF).to(torch.uint8)  # [..., m / 8, bits]
    return packed.reshape(*codes.shape[:-1], -1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes`: [..., m * bits / 8] bytes -> uint8 codes [..., m]."""
    if bits == 8:
        return packed
    if bits == 4:
        low, high = packed & 0x0F, packed >> 4
        return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)
    runs = packed.reshape(*packed.shape[:-1], -1, bits).to(torch.int64)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (runs << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = ((words >> shifts) & ((1 << bits) - 1)).to(torch.uint8)  # [..., m / 8, 8]
    return codes.reshape(*packed.shape[:-1], -1)
