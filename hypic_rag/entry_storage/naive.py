"""Reference group quantization, one group and one value at a time in Python floats: the maths `quantize.py`
vectorises, written out plainly so the tests can compare the two on random inputs (small tensors only)."""

from __future__ import annotations

import struct

import torch

from hypic_rag.entry_storage.quantize import FLOAT8_MAX


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


def round_trip_int(tensor: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """`tensor` [..., D] quantized to `bits`-bit integer groups of `group` and decoded (float32)."""
    largest = 2 ** (bits - 1) - 1
    decoded: list[float] = []
    for values in _groups(tensor, group):
        scale = _scale_of(values, largest)
        divisor = scale if scale > 0 else 1.0
        for value in values:
            quotient = float(torch.tensor(value, dtype=torch.float32) / torch.tensor(divisor, dtype=torch.float32))
            code = max(-largest, min(largest, round_half_even(quotient)))
            decoded.append(float(torch.tensor(code, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)))
    return torch.tensor(decoded, dtype=torch.float32).reshape(tensor.shape)


def round_trip_float8(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """`tensor` [..., D] quantized to float8 e4m3 groups of `group` and decoded (float32)."""
    decoded: list[float] = []
    for values in _groups(tensor, group):
        scale = _scale_of(values, FLOAT8_MAX)
        divisor = scale if scale > 0 else 1.0
        for value in values:
            quotient = float(torch.tensor(value, dtype=torch.float32) / torch.tensor(divisor, dtype=torch.float32))
            code = float(torch.tensor(max(-FLOAT8_MAX, min(FLOAT8_MAX, quotient))).to(torch.float8_e4m3fn).float())
            decoded.append(float(torch.tensor(code, dtype=torch.float32) * torch.tensor(scale, dtype=torch.float32)))
    return torch.tensor(decoded, dtype=torch.float32).reshape(tensor.shape)


def round_half_even(value: float) -> int:
    """Python's round (half to even), as torch.round."""
    return int(round(value))


def pack_codes(codes: list[int], bits: int) -> bytes:
    """Codes below 2^bits packed little-endian: code i occupies bits [bits * i, bits * (i + 1)) of the stream."""
    stream = 0
    for position, code in enumerate(codes):
        stream |= code << (bits * position)
    return stream.to_bytes(len(codes) * bits // 8, "little")


def unpack_codes(data: bytes, bits: int) -> list[int]:
    """The inverse of `pack_codes`."""
    stream = int.from_bytes(data, "little")
    return [(stream >> (bits * position)) & ((1 << bits) - 1) for position in range(len(data) * 8 // bits)]
