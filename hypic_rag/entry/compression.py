"""Cache formats: how each kind of an entry's tensors is stored, and the decoding of any stored form.

A `CacheFormat` gives every tensor kind its `TensorCoding`:

- ``transition`` (P), ``suffix_state`` (Z), ``conv_tail``, ``key_value`` (attention K and V);
- a coding is a float cast (``float32``, ``float16``, ``bfloat16``), ``int{bits}/{group}`` (integer groups of at
  most `group` values along the last dimension, `bits` 2..8, a bfloat16 scale per group: `quantize.quantize_int`)
  or ``fp8/{group}`` (float8 e4m3 groups with a scale: `quantize.quantize_float8`);
- a group coding may even out columns first (``+cols``, the K/V of the ``-kv8`` formats) or group a tensor along
  its second-to-last dimension (`TensorCoding.transpose`: conv tails [C, kernel - 1] along their channels);
- a tensor a group coding cannot cut (its last dimension is not a multiple of 8: a scalar-decay P [H, 1, 1]) is
  stored in the coding's `fallback` float dtype; a tensor with a non-finite value, or one beyond float16's range
  for a float16 cast, keeps its dtype. Token ids and ``seam_tokens`` are never changed.

The stored form of a compressed tensor ``X`` is a set of parts (`hypic_rag.entry.schema.STORED_PART_SEPARATOR`):
``X#int{bits}`` (codes; ``X#int8.t`` when transposed) or ``X#fp8`` (float8 bytes) with ``X#scale`` and, with
``+cols``, ``X#columns``; a cast tensor keeps its name. Decoding (`decompress_entries`) needs no format: the parts
say how they were made, and it runs on whatever device the parts are moved to first. State tensors decode to
float32 (composition runs in float32), K/V to the model's dtype.

`CACHE_FORMATS` names the formats users choose from (`--cache-format`; `register_cache_format` adds one); `float32`
stores entries as encoded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.entry.schema import SEAM_TOKENS, STORED_PART_SEPARATOR, TOKEN_IDS, Entry, base_name
from hypic_rag.entry.quantize import (
    FLOAT8_MAX,
    dequantize_float8,
    dequantize_int,
    float8_supported,
    group_size,
    quantize_float8,
    quantize_int,
)

TENSOR_KINDS = ("transition", "suffix_state", "conv_tail", "key_value")
"""The kinds a format codes separately: P, Z, conv tails, attention K/V."""
STATE_KINDS = ("transition", "suffix_state", "conv_tail")
FLOAT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SCALE_PART = "scale"
COLUMNS_PART = "columns"
FLOAT8_PART = "fp8"
_CODES_PART = re.compile(r"(?:int(?P<bits>[2-8])|fp8)(?P<transposed>\.t)?")
_SPEC = re.compile(
    r"(?:(?P<float>float32|float16|bfloat16)|(?:int(?P<bits>[2-8])/(?P<group>\d+)|fp8/(?P<fp8>\d+))(?P<columns>\+cols)?)"
)


def tensor_kind(name: str) -> str | None:
    """The kind (`TENSOR_KINDS`) of the tensor named `name` (or of a stored part of it); None for token ids,
    ``seam_tokens`` and any other tensor."""
    name = base_name(name)
    for kind in STATE_KINDS:
        if name.endswith(f".{kind}"):
            return kind
    if name.endswith((".key", ".value")):
        return "key_value"
    return None


@dataclass(frozen=True, slots=True)
class TensorCoding:
    """How one tensor kind is stored; `spec` is one of ``float32``, ``float16``, ``bfloat16``, ``int{bits}/{group}``
    (bits 2..8, group a multiple of 8), ``fp8/{group}``; a group coding may end in ``+cols``: each column (last-dim
    index) of the tensor's last two dimensions is first divided by the square root of its largest magnitude over
    the rows, kept as a bfloat16 part (``X#columns`` [..., D]; 16 / rows more bits per value), so that a few large
    channels (keys' outlier channels) do not set every row group's scale. `fallback`: the float dtype of a tensor
    the group coding cannot cut (see the module). `transpose`: the last two dimensions are swapped before grouping
    (its codes part is ``X#int8.t``): a conv tail [C, kernel - 1] is grouped along its channels."""

    spec: str
    fallback: str = "float16"
    transpose: bool = False
    method: str = field(init=False)
    bits: int = field(init=False)
    group: int = field(init=False)
    columns: bool = field(init=False)

    def __post_init__(self) -> None:
        match = _SPEC.fullmatch(self.spec)
        if match is None:
            raise ValueError(f"unknown tensor coding {self.spec!r}; expected float32, float16, bfloat16, "
                             "int{bits}/{group} (bits 2-8) or fp8/{group}")
        if self.fallback not in FLOAT_DTYPES:
            raise ValueError(f"the fallback of a coding is one of {sorted(FLOAT_DTYPES)}, got {self.fallback!r}")
        if match["float"]:
            method, bits, group = "float", torch.finfo(FLOAT_DTYPES[self.spec]).bits, 0
        elif match["bits"]:
            method, bits, group = "int", int(match["bits"]), int(match["group"])
        else:
            method, bits, group = "fp8", 8, int(match["fp8"])
            if not float8_supported():
                raise ValueError("fp8 codings need torch's float8_e4m3fn dtype (torch >= 2.1)")
        if method != "float" and (group < 8 or group % 8):
            raise ValueError(f"a group size is a positive multiple of 8, got {group} in {self.spec!r}")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "bits", bits)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "columns", bool(match["columns"]))

    @property
    def bits_per_value(self) -> float:
        """Stored bits per value of a tensor this coding groups fully (codes plus the 16-bit scale per group)."""
        return float(self.bits) if self.method == "float" else self.bits + 16 / self.group

    @property
    def is_identity(self) -> bool:
        """Stores tensors as they are (float32 entries)."""
        return self.spec == "float32"

    def parts_of(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored parts of tensor `name` (see the module): itself, a cast copy, or codes and scales."""
        if self.is_identity or not tensor.is_floating_point() or not _finite(tensor):
            return {name: tensor}
        if self.method == "float":
            return {name: _cast(tensor, FLOAT_DTYPES[self.spec])}
        transposed = self.transpose and tensor.dim() >= 2
        if transposed:
            tensor = tensor.transpose(-1, -2)
        group = group_size(tensor.shape[-1], self.group) if tensor.dim() else None
        if group is None or tensor.numel() == 0:
            return {name: _cast(tensor.transpose(-1, -2) if transposed else tensor, FLOAT_DTYPES[self.fallback])}
        parts: dict[str, torch.Tensor] = {}
        if self.columns and tensor.dim() >= 2:
            columns = column_scales(tensor)
            parts[f"{name}{STORED_PART_SEPARATOR}{COLUMNS_PART}"] = columns
            tensor = tensor.float() / columns.float().unsqueeze(-2)
        if self.method == "fp8":
            codes, scale = quantize_float8(tensor, group)
            part = FLOAT8_PART
        else:
            codes, scale = quantize_int(tensor, self.bits, group)
            part = f"int{self.bits}"
        if transposed:
            part += ".t"
        return {f"{name}{STORED_PART_SEPARATOR}{part}": codes, f"{name}{STORED_PART_SEPARATOR}{SCALE_PART}": scale,
                **parts}


def column_scales(tensor: torch.Tensor) -> torch.Tensor:
    """bfloat16 [..., D]: the square root of each column's largest magnitude over the rows of `tensor` [..., R, D]
    (1 for an all-zero column): dividing by it evens out the columns' ranges before row groups are quantized."""
    largest = tensor.float().abs().amax(dim=-2)
    return torch.where(largest > 0, largest.sqrt(), torch.ones_like(largest)).to(torch.bfloat16)


def _finite(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or bool(torch.isfinite(tensor).all())


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype`, unless its values lie beyond that dtype's range (float16 tops out at 65504)."""
    if tensor.dtype == dtype:
        return tensor
    if not tensor.is_meta and tensor.numel() and torch.finfo(dtype).max < torch.finfo(tensor.dtype).max:
        if bool(tensor.abs().max() > torch.finfo(dtype).max):
            return tensor
    return tensor.to(dtype)


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """A named storage format: one `TensorCoding` per tensor kind, and what it is for (`summary`)."""

    name: str
    transition: TensorCoding
    suffix_state: TensorCoding
    conv_tail: TensorCoding
    key_value: TensorCoding
    summary: str = ""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name):
            raise ValueError(f"a cache format name is lower-case letters, digits, '_', '.', '-'; got {self.name!r}")

    def coding(self, kind: str) -> TensorCoding:
        """The coding of tensor kind `kind` (one of `TENSOR_KINDS`)."""
        if kind not in TENSOR_KINDS:
            raise ValueError(f"unknown tensor kind {kind!r}; expected one of {', '.join(TENSOR_KINDS)}")
        return getattr(self, kind)

    @property
    def lossless(self) -> bool:
        """Stores every tensor as encoded."""
        return all(self.coding(kind).is_identity for kind in TENSOR_KINDS)

    def codings(self) -> dict[str, str]:
        """Tensor kind -> coding spec (with its fallback where it is not float16, "along channels" when transposed)."""
        described = {}
        for kind in TENSOR_KINDS:
            coding = self.coding(kind)
            notes = [] if coding.method == "float" else [
                *(["along channels"] if coding.transpose else []),
                *([f"else {coding.fallback}"] if coding.fallback != "float16" else []),
            ]
            described[kind] = coding.spec + (f" ({', '.join(notes)})" if notes else "")
        return described

    def compress(self, entry: Mapping[str, torch.Tensor]) -> Entry:
        """The stored form of `entry` (a new dict; tensors kept as they are where the coding is the identity)."""
        if self.lossless:
            return dict(entry)
        stored: Entry = {}
        for name, tensor in entry.items():
            kind = tensor_kind(name)
            if kind is None or STORED_PART_SEPARATOR in name:
                stored[name] = tensor
            else:
                stored.update(self.coding(kind).parts_of(name, tensor))
        return stored


CONV_TAIL_8 = "int8/128"
"""Conv tails of the group formats, grouped along the channels (their error: docs/cache.md)."""
KEY_VALUE_8 = "int8/128+cols"
"""K/V of the mixed (`-kv8`) formats: 8 bits with the key channels evened out (docs/cache.md says why)."""


def _format(name: str, state: str, key_value: str, summary: str, *, conv_tail: str = CONV_TAIL_8) -> CacheFormat:
    """P and Z in `state` (a P that cannot be grouped, a scalar decay, in float32), conv tails in `conv_tail` (a
    group coding: along the channels), K/V in `key_value`."""
    return CacheFormat(
        name,
        transition=TensorCoding(state, fallback="float32"),
        suffix_state=TensorCoding(state),
        conv_tail=TensorCoding(conv_tail, transpose=conv_tail not in FLOAT_DTYPES),
        key_value=TensorCoding(key_value),
        summary=summary,
    )


CACHE_FORMATS: dict[str, CacheFormat] = {}
"""The formats a cache can be built in, by name (`--cache-format`), in registration order: the one list that
`--cache-format`, `hypic-rag cache formats`, the service's config, format calibration's candidates and the cache
formats bench read."""


def register_cache_format(cache_format: CacheFormat) -> CacheFormat:
    """Register `cache_format` under its name; ValueError for a name registered to another format."""
    known = CACHE_FORMATS.get(cache_format.name)
    if known is not None and known != cache_format:
        raise ValueError(f"cache format {cache_format.name!r} is registered already")
    CACHE_FORMATS[cache_format.name] = cache_format
    return cache_format


def _builtin_formats() -> list[CacheFormat]:
    """The formats this package registers: float32 first (the reference), then by falling bits per value."""
    formats = [
        CacheFormat("float32", *(TensorCoding("float32") for _ in TENSOR_KINDS),
                    summary="every tensor as encoded (the reference)"),
        _format("float16", "float16", "float16", "P, Z, conv tails and K/V in float16", conv_tail="float16"),
        _format("bfloat16", "bfloat16", "bfloat16", "P, Z, conv tails and K/V in bfloat16", conv_tail="bfloat16"),
        _format("int8", "int8/128", "int8/128", "8-bit integer groups of 128 with a bfloat16 scale"),
        _format("int7-kv8", "int7/128", KEY_VALUE_8, "P and Z as int7; K/V in 8 bits, columns evened out"),
        _format("int7", "int7/128", "int7/128", "7-bit integer groups of 128 with a bfloat16 scale"),
        _format("int6-kv8", "int6/128", KEY_VALUE_8, "P and Z as int6; K/V in 8 bits, columns evened out"),
        _format("int6", "int6/128", "int6/128", "6-bit integer groups of 128 with a bfloat16 scale"),
        _format("int5", "int5/64", "int5/64", "5-bit integer groups of 64 with a bfloat16 scale"),
        _format("int4-kv8", "int4/32", KEY_VALUE_8, "P and Z as int4; K/V in 8 bits, columns evened out"),
        _format("int4", "int4/32", "int4/32", "4-bit integer groups of 32 with a bfloat16 scale"),
        _format("int3", "int3/32", "int3/32", "3-bit integer groups of 32 with a bfloat16 scale"),
    ]
    if float8_supported():
        formats.insert(3, _format("fp8", "fp8/128", "fp8/128", "float8 e4m3 groups of 128 with a bfloat16 scale"))
    return formats


for _cache_format in _builtin_formats():
    register_cache_format(_cache_format)
DEFAULT_CACHE_FORMAT = "float32"


def cache_format(name: str | CacheFormat) -> CacheFormat:
    """The registered format called `name` (a `CacheFormat` is returned as it is); ValueError naming the choices."""
    if isinstance(name, CacheFormat):
        return name
    found = CACHE_FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown cache format {name!r}; choose one of {', '.join(CACHE_FORMATS)}")
    return found


def compress_entry(entry: Mapping[str, torch.Tensor], name: str | CacheFormat) -> Entry:
    """`entry` in its stored form under the format `name` (`CacheFormat.compress`)."""
    return cache_format(name).compress(entry)


def is_compressed(entry: Mapping[str, torch.Tensor]) -> bool:
    """Whether `entry` holds stored parts that need decoding (not only float tensors under their own names)."""
    return any(STORED_PART_SEPARATOR in name for name in entry)


FLOAT32_MAX = torch.finfo(torch.float32).max


def stored_form_problem(stored: Mapping[str, torch.Tensor]) -> str | None:
    """Why an entry's stored form would not decode to finite values (one line naming the tensor), or None.

    Checked, for the tensors of `TENSOR_KINDS` (state, conv tails, K/V, and their stored parts): every floating one
    (a value stored as a float, a group scale, a column scale) is finite; no float8 code is e4m3fn's NaN (bits
    x111 1111); no coded tensor's largest code times its largest scale (and column scale) overflows float32. So the
    decoded values are finite whenever this is None. One pass over the floating tensors and float8 codes, the
    scales' maxima for the rest."""
    present = {name: tensor for name, tensor in stored.items()
               if not tensor.is_meta and tensor.numel() and tensor_kind(name) is not None}
    for name, tensor in present.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {name!r} holds a NaN or an infinity"
    for name, tensor in present.items():
        tensor_name, separator, part = name.partition(STORED_PART_SEPARATOR)
        codes = _CODES_PART.fullmatch(part) if separator else None
        if codes is None:
            continue
        if codes["bits"] is None and bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any()):
            return f"tensor {name!r} holds a float8 NaN code"
        largest = FLOAT8_MAX if codes["bits"] is None else 2 ** (int(codes["bits"]) - 1) - 1
        for factor in (SCALE_PART, COLUMNS_PART):
            scale = present.get(f"{tensor_name}{STORED_PART_SEPARATOR}{factor}")
            if scale is not None:
                largest *= float(scale.float().abs().max())
        if largest > FLOAT32_MAX:
            return f"tensor {tensor_name!r} decodes past float32's range (codes up to {largest:.3g})"
    return None


def decompress_entry(
    stored: Mapping[str, torch.Tensor], device: torch.device | str | None = None,
    key_value_dtype: torch.dtype | None = None,
) -> Entry:
    """The entry a stored form stands for (`decompress_entries` of one entry)."""
    return decompress_entries([stored], device, key_value_dtype)[0]


@dataclass(frozen=True, slots=True)
class _Coded:
    """One compressed tensor of a stored form: where it goes (entry number, name), its parts, its dtype out."""

    entry: int
    name: str
    codes: torch.Tensor
    scale: torch.Tensor
    columns: torch.Tensor | None
    dtype: torch.dtype


def decompress_entries(
    stored_entries: Sequence[Mapping[str, torch.Tensor]], device: torch.device | str | None = None,
    key_value_dtype: torch.dtype | None = None,
) -> list[Entry]:
    """The entries stored forms stand for, on `device` (None: where they lie), decoded there: codes and scales are
    moved first, then expanded. State tensors (P, Z, conv tails) come out in float32; K/V in `key_value_dtype`
    (None: float32 for a decoded one, its own dtype for one stored as a float). Token ids and other tensors are
    only moved. An entry already in that form on `device` is returned as it is (no copy).

    Compressed tensors of the same coding and row shape, across all the entries (a request's chunks, all layers),
    are decoded together: one move and one expansion per coding, instead of a dozen small operations per tensor.
    The decoded tensors are views of that expansion (treat them as read-only, as every entry)."""
    target = torch.device(device) if device is not None else None
    decoded: list[Entry | None] = [None] * len(stored_entries)
    plain: list[dict[str, torch.Tensor]] = [{} for _ in stored_entries]
    groups: dict[tuple[Any, ...], list[_Coded]] = {}
    for number, stored in enumerate(stored_entries):
        if not is_compressed(stored) and all(_settled(name, tensor, target, key_value_dtype)
                                             for name, tensor in stored.items()):
            decoded[number] = stored if isinstance(stored, dict) else dict(stored)
            continue
        for name, tensor in stored.items():
            tensor_name, separator, part = name.partition(STORED_PART_SEPARATOR)
            if not separator:
                moved = tensor if target is None else tensor.to(target, non_blocking=True)
                dtype = _decoded_dtype(tensor_name, tensor, key_value_dtype)
                plain[number][name] = moved if dtype is None or moved.dtype == dtype else moved.to(dtype)
                continue
            if part in (SCALE_PART, COLUMNS_PART):
                continue
            if _CODES_PART.fullmatch(part) is None:
                raise ValueError(f"unknown stored part {name!r}")
            scale = stored.get(f"{tensor_name}{STORED_PART_SEPARATOR}{SCALE_PART}")
            if scale is None:
                raise ValueError(f"stored part {name!r} has no scale")
            dtype = key_value_dtype if tensor_kind(tensor_name) == "key_value" and key_value_dtype else torch.float32
            coded = _Coded(number, tensor_name, tensor, scale,
                           stored.get(f"{tensor_name}{STORED_PART_SEPARATOR}{COLUMNS_PART}"), dtype)
            groups.setdefault((part, tuple(tensor.shape[-2:]), tensor.dtype), []).append(coded)
    for (part, _, _), members in groups.items():
        layout = _CODES_PART.fullmatch(part)
        assert layout is not None
        for coded, values in zip(members, _expand(part, members, target)):
            if coded.columns is not None:  # the columns of the grouped layout (before any transposition back)
                columns = coded.columns if target is None else coded.columns.to(target, non_blocking=True)
                values.mul_(columns.float().unsqueeze(-2))
            if layout["transposed"]:
                values = values.transpose(-1, -2).contiguous()
            plain[coded.entry][coded.name] = values.to(coded.dtype)
    for number, stored in enumerate(stored_entries):
        if decoded[number] is None:  # in the stored form's order of tensors
            names = dict.fromkeys(name.partition(STORED_PART_SEPARATOR)[0] for name in stored)
            decoded[number] = {name: plain[number][name] for name in names}
    return decoded  # type: ignore[return-value]


def _expand(part: str, members: list[_Coded], target: torch.device | None) -> list[torch.Tensor]:
    """float32 values of each member (same part and row shape), decoded in one pass; each in its own shape."""
    rows = [math.prod(coded.codes.shape[:-2]) for coded in members]
    codes = torch.cat([coded.codes.reshape(-1, *coded.codes.shape[-2:]) for coded in members])
    scale = torch.cat([coded.scale.reshape(-1, coded.scale.shape[-1]) for coded in members])
    if target is not None:
        codes, scale = codes.to(target, non_blocking=True), scale.to(target, non_blocking=True)
    bits = _CODES_PART.fullmatch(part)["bits"]  # type: ignore[index]
    values = dequantize_float8(codes, scale) if bits is None else dequantize_int(codes, scale, int(bits))
    pieces = torch.split(values, rows)
    return [piece.reshape(*coded.codes.shape[:-2], piece.shape[-1]) for coded, piece in zip(members, pieces)]


def _decoded_dtype(name: str, tensor: torch.Tensor, key_value_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a tensor stored under its own name is handed out in (None: its own)."""
    if not tensor.is_floating_point() or name in (TOKEN_IDS, SEAM_TOKENS):
        return None
    kind = tensor_kind(name)
    if kind is None:
        return None
    if kind == "key_value":
        return key_value_dtype
    return torch.float32


def _settled(name: str, tensor: torch.Tensor, device: torch.device | None, key_value_dtype: torch.dtype | None) -> bool:
    if device is not None and tensor.device != device and not (device.type == tensor.device.type and device.index is None):
        return False
    dtype = _decoded_dtype(name, tensor, key_value_dtype)
    return dtype is None or tensor.dtype == dtype
