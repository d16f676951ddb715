"""Reference group quantization, one group and one value at a time in Python floats: the maths `quantize.py`
vectorises, written out plainly so the tests can compare the two on random inputs (small tensors only)."""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

from hypic_rag.entry.quantize import FLOAT8_MAX, PLANE_WIDTHS


def bfloat16_round_up(value: float) -> float:
    """The smallest bfloat16 >= `value` (a non-negative finite float32), as a Python float."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if bits & 0xFFFF:
        bits = (bits | 0xFFFF) + 1
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFF0000))[0]


def _groups(tensor: torch.Tensor, group: int) -> list[list[float]]:
    rows = tensor.float().reshape(-1, tensor.shape[-1]).tolist()
    return [row[start:start + group] for row in rows for start in range(0, len(row), group)]


def _scale_of(values: list[float], largest_code: float) -> float:
    # in float32, as the vectorised path divides
    ratio = float(torch.tensor(max(abs(value) for value in values)) / largest_code)
    return bfloat16_round_up(ratio)


def _round_trip(tensor: torch.Tensor, group: int, largest_code: float, code_of: Callable[[float], float]) -> torch.Tensor:
    """`tensor` [..., D] cut into groups of `group`, each scaled by its bfloat16-rounded-up absmax / `largest_code`,
    every quotient coded by `code_of` and decoded (float32, one value at a time)."""
    decoded: list[float] = []
    for values in _groups(tensor, group):
        scale = _scale_of(values, largest_code)
        divisor = scale if scale > 0 else 1.0
        for value in values:
            quotient = float(torch.tensor(value, dtype=torch.float32) / torch.tensor(divisor, dtype=torch.float32))
            code = code_of(quotient)
            decoded.append(float(torch.tensor(code, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)))
    return torch.tensor(decoded, dtype=torch.float32).reshape(tensor.shape)


def round_trip_int(tensor: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """`tensor` [..., D] quantized to `bits`-bit integer groups of `group` and decoded (float32)."""
    largest = 2 ** (bits - 1) - 1
    return _round_trip(tensor, group, largest, lambda quotient: max(-largest, min(largest, round_half_even(quotient))))


def round_trip_float8(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """`tensor` [..., D] quantized to float8 e4m3 groups of `group` and decoded (float32)."""

    def code_of(quotient: float) -> float:
        clipped = max(-FLOAT8_MAX, min(FLOAT8_MAX, quotient))
        return float(torch.tensor(clipped).to(torch.float8_e4m3fn).float())

    return _round_trip(tensor, group, FLOAT8_MAX, code_of)


def round_half_even(value: float) -> int:
    """Python's round (half to even), as torch.round."""
    return int(round(value))


def pack_codes(codes: list[int], bits: int) -> bytes:
    """One row of codes below 2^bits packed as `quantize.pack_codes` lays it out: for each plane of
    `PLANE_WIDTHS[bits]` (most significant bits first) of r = len(codes) * width / 8 bytes, byte j holds the plane's
    bits of codes j, j + r, j + 2r, ... at bit offsets 0, width, 2 width, ..."""
    if bits == 8:
        return bytes(codes)
    data = bytearray()
    shift = bits
    for width in PLANE_WIDTHS[bits]:
        shift -= width
        rows = len(codes) * width // 8
        for byte_number in range(rows):
            byte = 0
            for index in range(8 // width):
                byte |= ((codes[byte_number + index * rows] >> shift) & ((1 << width) - 1)) << (width * index)
            data.append(byte)
    return bytes(data)


def unpack_codes(data: bytes, bits: int) -> list[int]:
    """The inverse of `pack_codes` for one row."""
    if bits == 8:
        return list(data)
    count = len(data) * 8 // bits
    codes = [0] * count
    offset, shift = 0, bits
    for width in PLANE_WIDTHS[bits]:
        shift -= width
        rows = count * width // 8
        for position in range(count):
            byte = data[offset + position % rows]
            codes[position] |= ((byte >> (width * (position // rows))) & ((1 << width) - 1)) << shift
        offset += rows
    return codes
