"""Group quantization of a tensor along its last dimension, each group with its own bfloat16 scale.

A tensor x [..., D] is cut into groups of `group` values along its last dimension (D = n_groups * group,
`group` a multiple of 8). Per group g:

- integers of `bits` bits (2..8): scale s_g = absmax(x_g) / qmax rounded *up* to bfloat16 (so no value clips),
  qmax = 2^(bits-1) - 1; codes q = round(x / s_g) in [-qmax, qmax]; decoded x_hat = q * s_g, so
  |x - x_hat| <= s_g / 2 for every value. Codes of fewer than 8 bits are stored biased (q + 2^(bits-1), in
  [1, 2^bits - 1]) and packed in bit planes of 4, 2 and 1 bits (`pack_codes`): `bits` bytes per 8 codes.
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
    values = (codes if bits == 8 else unpack_codes(codes, bits)).to(torch.float32)  # a new tensor: changed in place
    if bits != 8:
        values.sub_(2 ** (bits - 1))
    values.mul_(scale.float().unsqueeze(-1))
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
    values = codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    values.mul_(scale.float().unsqueeze(-1))
    return values.reshape(*values.shape[:-2], -1).to(dtype)


PLANE_WIDTHS: dict[int, tuple[int, ...]] = {
    2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1), 8: (8,),
}
"""The bit planes a code of each width is split into, most significant first: widths that divide a byte."""
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _byte_mask(width: int, word_bytes: int) -> int:
    """The low `width` bits of every byte of a word, as a signed integer of that word (int64 wraps)."""
    mask = int.from_bytes(bytes([(1 << width) - 1]) * word_bytes, "little")
    return mask - (1 << (8 * word_bytes)) if mask >= 1 << (8 * word_bytes - 1) else mask


def _word(*sizes: int) -> tuple[int, torch.dtype]:
    """The widest integer word whose size divides every one of `sizes` (bytes)."""
    return next((size, dtype) for size, dtype in _WORDS if all(value % size == 0 for value in sizes))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., g] below 2^bits (g a multiple of 8) packed into [..., g * bits / 8] bytes, in bit planes.

    The code's bits are split into `PLANE_WIDTHS[bits]` (most significant first); the plane of width w takes
    r = g * w / 8 bytes of the row, and its byte j holds the bits of codes j, j + r, j + 2r, ... (8 / w of them) at
    bit offsets 0, w, 2w, ...; the planes follow one another along the row. So unpacking a plane is a shift and a
    byte mask per code position on whole words (8 bytes at a time) and one concatenation: no interleaving."""
    group = codes.shape[-1]
    if group % 8:
        raise ValueError(f"packing needs a multiple of 8 codes per row, got {group}")
    if bits == 8:
        return codes
    planes = []
    shift = bits
    for width in PLANE_WIDTHS[bits]:
        shift -= width
        plane = (codes >> shift) & ((1 << width) - 1)
        rows = group * width // 8
        packed = plane[..., :rows].clone()
        for index in range(1, 8 // width):
            packed |= plane[..., index * rows:(index + 1) * rows] << (width * index)
        planes.append(packed)
    return torch.cat(planes, dim=-1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_codes`: [..., g * bits / 8] bytes -> uint8 codes [..., g] (contiguous)."""
    if bits == 8:
        return packed
    packed = packed.contiguous()
    group = packed.shape[-1] * 8 // bits
    sizes = [group * width // 8 for width in PLANE_WIDTHS[bits]]
    word_bytes, word = _word(*sizes, packed.shape[-1])
    codes: torch.Tensor | None = None
    offset, shift = 0, bits
    for width, size in zip(PLANE_WIDTHS[bits], sizes):
        shift -= width
        words = packed[..., offset:offset + size].view(word)  # the plane, a word at a time
        offset += size
        mask = _byte_mask(width, word_bytes)
        values = torch.cat([(words >> (width * index)) & mask for index in range(8 // width)], dim=-1)
        if shift:  # every byte stays below 256: a word-wide shift moves no bit into the next byte
            values <<= shift
        codes = values if codes is None else codes.bitwise_or_(values)
    assert codes is not None
    return codes.view(torch.uint8)
