"""Entry codec: bit-exact round trips of any entry, and every kind of damage detected."""

from __future__ import annotations

import struct

import pytest
import torch

from hypic_rag.cache.codec import ALIGNMENT, CODEC_VERSION, PRELUDE_BYTES, decode_entry, encode_entry, read_header
from hypic_rag.cache.errors import CorruptEntryError, IncompatibleEntryError
from hypic_rag.entry.compression import CACHE_FORMATS, compress_entry, decompress_entry
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.entry.schema import entry_bytes


def assert_same_entry(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, tensor in expected.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        # bit-exact: compare raw bytes, so NaN payloads and -0.0 count too
        assert got.contiguous().reshape(-1).view(torch.uint8).tolist() == (
            tensor.contiguous().reshape(-1).view(torch.uint8).tolist()
        ), name


def odd_entry() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    strided = torch.randn(6, 5, generator=generator).t()  # non-contiguous
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])
    return {
        "token_ids": torch.tensor([5, 9, 2**40], dtype=torch.int64),
        "layers.0.transition": torch.randn(2, 3, 3, generator=generator).half(),
        "layers.0.suffix_state": torch.randn(2, 3, 4, generator=generator).bfloat16(),
        "layers.1.key": torch.zeros(2, 0, 8),  # a 0-size tensor
        "layers.1.value": strided,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "small_ints": torch.tensor([-3, 7], dtype=torch.int8),
        "special": special,
    }


def test_round_trip_is_bit_exact_for_any_entry() -> None:
    entry = odd_entry()
    value = encode_entry(entry, "namespace text")
    decoded = decode_entry(value)
    assert decoded.namespace == "namespace text"
    assert_same_entry(decoded.tensors, {name: tensor.contiguous() for name, tensor in entry.items()})


def test_round_trip_of_a_realistic_entry_and_aligned_zero_copy_views() -> None:
    entry = synthetic_entry(TINY_SHAPE, list(range(40)), seed=1)
    value = encode_entry(entry, "ns")
    decoded = decode_entry(value)
    assert_same_entry(decoded.tensors, entry)
    base = torch.frombuffer(value, dtype=torch.uint8).data_ptr()
    for name, tensor in decoded.tensors.items():
        if tensor.numel():
            offset = tensor.data_ptr() - base
            assert 0 <= offset < len(value) and offset % ALIGNMENT == 0, name  # a view into the value: no copy
    decoded.tensors["layers.0.transition"].add_(1.0)  # writable views of the very bytes that were decoded:
    with pytest.raises(CorruptEntryError):  # writing through them changes the value, so its crc no longer holds
        decode_entry(value)


@pytest.mark.parametrize("region", ["magic", "prelude", "header", "payload_first", "payload_last"])
def test_a_flipped_byte_anywhere_is_detected(region: str) -> None:
    value = encode_entry(synthetic_entry(TINY_SHAPE, list(range(12)), seed=2), "ns")
    header_length = struct.unpack_from("<I", value, 8)[0]
    position = {
        "magic": 1,
        "prelude": 20,
        "header": PRELUDE_BYTES + header_length // 2,
        "payload_first": PRELUDE_BYTES + header_length + (ALIGNMENT - (PRELUDE_BYTES + header_length) % ALIGNMENT),
        "payload_last": len(value) - 1,
    }[region]
    value[position] ^= 0x10
    with pytest.raises(CorruptEntryError):
        decode_entry(value)


@pytest.mark.parametrize("keep", [0, 10, PRELUDE_BYTES, 200, -1])
def test_a_truncated_value_is_detected(keep: int) -> None:
    value = encode_entry(synthetic_entry(TINY_SHAPE, list(range(12))), "ns")
    with pytest.raises(CorruptEntryError):
        decode_entry(value[: keep if keep >= 0 else len(value) - 1])


def test_another_codec_version_is_incompatible_not_decoded() -> None:
    value = encode_entry({"token_ids": torch.arange(3)}, "ns")
    struct.pack_into("<H", value, 4, CODEC_VERSION + 1)
    # re-seal the crc so only the version differs (an intact value written by another release)
    import zlib

    struct.pack_into("<I", value, 12, zlib.crc32(memoryview(value)[16:]))
    with pytest.raises(IncompatibleEntryError):
        decode_entry(value)


def test_read_only_buffers_are_accepted_and_header_reads_without_payload() -> None:
    entry = synthetic_entry(TINY_SHAPE, [1, 2, 3])
    value = bytes(encode_entry(entry, "ns"))
    assert_same_entry(decode_entry(value).tensors, entry)
    namespace, specs = read_header(value)
    assert namespace == "ns" and [spec.name for spec in specs] == list(entry)
    assert sum(spec.nbytes for spec in specs) == entry_bytes(entry).tensor_bytes


def test_unsupported_values_are_refused() -> None:
    with pytest.raises(TypeError):
        encode_entry({"x": torch.zeros(2, dtype=torch.complex64)}, "ns")
    with pytest.raises(TypeError):
        encode_entry({"x": [1, 2]}, "ns")  # type: ignore[dict-item]


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_every_cache_formats_stored_form_round_trips_bit_exactly(name: str) -> None:
    """Codes (int8, packed uint8, float8 bytes), bfloat16 scales and cast tensors survive the codec unchanged, and
    the value shrinks with the format."""
    entry = synthetic_entry(TINY_SHAPE, list(range(9)))
    stored = compress_entry(entry, name)
    value = encode_entry(stored, "ns")
    decoded = decode_entry(value)
    assert_same_entry(decoded.tensors, {key: tensor.contiguous() for key, tensor in stored.items()})
    assert entry_bytes(decoded.tensors) == entry_bytes(stored)
    assert len(value) <= len(encode_entry(entry, "ns"))
    restored = decompress_entry(decoded.tensors, None, torch.float32)
    assert {key: tensor.dtype for key, tensor in restored.items()} == {key: t.dtype for key, t in entry.items()}
    assert torch.equal(restored["token_ids"], entry["token_ids"])
