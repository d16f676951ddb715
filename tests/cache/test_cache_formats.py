"""Cache formats (`hypic_rag.entry`): the vectorised group quantizers against the one-value-at-a-time
reference on random inputs, their error bounds against the float32 values, bit packing, and whole entries."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.entry.schema import entry_bytes, is_kv_name
from hypic_rag.entry import naive
from hypic_rag.entry.compression import (
    CACHE_FORMATS,
    TensorCoding,
    cache_format,
    compress_entry,
    decompress_entry,
    is_compressed,
    tensor_kind,
)
from hypic_rag.entry.quantize import (
    ceil_to_bfloat16,
    dequantize_float8,
    dequantize_int,
    float8_supported,
    group_size,
    pack_codes,
    quantize_float8,
    quantize_int,
    unpack_codes,
)


def random_tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Standard normal values with a few large ones and an all-zero row (an outlier and an empty group)."""
    generator = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=generator) * torch.rand(shape[:-1] + (1,), generator=generator) * 3
    tensor.reshape(-1)[:: max(1, tensor.numel() // 5)] *= 40
    tensor.reshape(-1, shape[-1])[1] = 0
    return tensor


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("group", [8, 16, 32])
def test_integer_groups_match_the_reference_and_stay_within_half_a_step(bits: int, group: int) -> None:
    tensor = random_tensor((3, 2, 64), seed=bits * 100 + group)
    codes, scale = quantize_int(tensor, bits, group)
    assert scale.dtype == torch.bfloat16 and scale.shape == (3, 2, 64 // group)
    assert codes.shape == (3, 2, 64 // group, group * bits // 8)
    decoded = dequantize_int(codes, scale, bits)
    assert torch.equal(decoded, naive.round_trip_int(tensor, bits, group))
    steps = scale.float().repeat_interleave(group, dim=-1)
    assert bool(((decoded - tensor).abs() <= steps / 2 * (1 + 1e-6)).all())
    assert torch.equal(decoded.reshape(-1, 64)[1], torch.zeros(64))  # the all-zero row decodes to zeros


@pytest.mark.skipif(not float8_supported(), reason="no float8_e4m3fn in this torch")
@pytest.mark.parametrize("group", [8, 32, 64])
def test_float8_groups_match_the_reference_and_their_relative_bound(group: int) -> None:
    tensor = random_tensor((4, 64), seed=group)
    codes, scale = quantize_float8(tensor, group)
    assert codes.dtype == torch.uint8 and codes.shape == (4, 64 // group, group)
    decoded = dequantize_float8(codes, scale)
    assert torch.equal(decoded, naive.round_trip_float8(tensor, group))
    steps = scale.float().repeat_interleave(group, dim=-1)
    bound = torch.maximum(tensor.abs() * 2**-4, steps * 2**-10) * (1 + 1e-6)
    assert bool(((decoded - tensor).abs() <= bound).all())


def test_scales_round_up_to_bfloat16_exactly() -> None:
    values = torch.tensor([0.0, 1.0, 1.0000001, 3.14159, 1e-30, 6e4, 2.5e-41])
    rounded = ceil_to_bfloat16(values)
    assert rounded.dtype == torch.bfloat16
    assert rounded.float().tolist() == [naive.bfloat16_round_up(float(v)) for v in values.tolist()]
    assert bool((rounded.float() >= values).all())


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_packing_matches_the_reference_bit_stream_and_inverts(bits: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (3, 40), generator=generator, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 40 * bits // 8)
    for row, packed_row in zip(codes.tolist(), packed.tolist()):
        assert bytes(packed_row) == naive.pack_codes(row, bits)
        assert naive.unpack_codes(bytes(packed_row), bits) == row
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_group_size_is_the_largest_multiple_of_8_dividing_the_last_dimension() -> None:
    assert group_size(256, 128) == 128
    assert group_size(96, 64) == 48
    assert group_size(32, 128) == 32
    assert group_size(40, 32) == 8  # 40 = 5 x 8: 8 is its only multiple-of-8 divisor up to 32
    assert group_size(3, 128) is None and group_size(1, 32) is None


def test_tensor_codings_parse_and_refuse_bad_specs() -> None:
    coding = TensorCoding("int5/64")
    assert (coding.method, coding.bits, coding.group) == ("int", 5, 64)
    assert TensorCoding("bfloat16").bits == 16
    for bad in ("int9/32", "int4/12", "int4", "fp8/0", "float64", "int1/8"):
        with pytest.raises(ValueError):
            TensorCoding(bad)
    with pytest.raises(ValueError, match="unknown cache format 'int2'"):
        cache_format("int2")


def test_tensor_kinds_follow_the_names_and_stored_parts() -> None:
    assert tensor_kind("layers.0.transition") == "transition"
    assert tensor_kind("layers.3.key#int8") == "key_value" and is_kv_name("layers.3.value#scale")
    assert tensor_kind("token_ids") is None and tensor_kind("seam_tokens") is None


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_every_format_decodes_every_tensor_within_its_codings_bound(name: str) -> None:
    entry = synthetic_entry(TINY_SHAPE, list(range(40)), seed=3)
    cache = cache_format(name)
    stored = compress_entry(entry, name)
    assert is_compressed(stored) == (cache.coding("suffix_state").method != "float")
    assert torch.equal(stored["token_ids"], entry["token_ids"]) and torch.equal(stored["seam_tokens"], entry["seam_tokens"])
    decoded = decompress_entry(stored, None, torch.float32)  # a float32 model's K/V dtype
    assert list(decoded) == list(entry)
    for tensor_name, tensor in entry.items():
        got = decoded[tensor_name]
        assert got.shape == tensor.shape and got.dtype == tensor.dtype, tensor_name
        kind = tensor_kind(tensor_name)
        if kind is None:
            assert torch.equal(got, tensor)
            continue
        coding = cache.coding(kind)
        error = float((got - tensor).abs().max())
        scale = float(tensor.abs().max())
        if coding.is_identity:
            assert error == 0
        elif coding.method == "int":
            assert error <= scale / (2 ** (coding.bits - 1) - 1) * 0.51, tensor_name
        else:  # float casts, fp8 and float16 fallbacks: relative to the largest value
            assert error <= scale * 2**-3, tensor_name
    if not cache.lossless:
        assert entry_bytes(stored).tensor_bytes < entry_bytes(entry).tensor_bytes


def test_decoding_targets_float32_state_and_the_model_dtype_for_keys_and_values() -> None:
    entry = synthetic_entry(TINY_SHAPE, list(range(24)), seed=5)
    decoded = decompress_entry(compress_entry(entry, "int8"), "cpu", torch.bfloat16)
    assert decoded["layers.0.transition"].dtype == torch.float32
    assert decoded["layers.0.conv_tail"].dtype == torch.float32  # stored in float16, handed back in float32
    assert decoded["layers.3.key"].dtype == torch.bfloat16 and decoded["layers.3.value"].dtype == torch.bfloat16
    assert decompress_entry(entry) is entry  # float32 entries on their device: no copy


def test_non_finite_and_out_of_range_tensors_keep_their_values() -> None:
    entry = synthetic_entry(TINY_SHAPE, list(range(8)), seed=2)
    entry["layers.0.suffix_state"][0, 0, 0] = float("inf")
    entry["layers.1.suffix_state"] *= 1e6  # beyond float16
    stored = compress_entry(entry, "int4")
    assert torch.equal(stored["layers.0.suffix_state"], entry["layers.0.suffix_state"])
    assert "layers.1.suffix_state#int4" in stored  # scaled groups take any finite range
    half = compress_entry(entry, "float16")
    assert half["layers.1.suffix_state"].dtype == torch.float32 and half["layers.2.suffix_state"].dtype == torch.float16


@pytest.mark.parametrize("spec", ["int6/32+cols", "int8/16+cols", "fp8/32+cols"])
def test_column_equalization_round_trips_within_the_bound_of_the_equalized_values(spec: str) -> None:
    """`+cols`: each column divided by sqrt(its largest magnitude) before the row groups are quantized, multiplied
    back after; the error bound is the row group's half step times the column scale, and an outlier column no
    longer coarsens every row (much smaller error than without it)."""
    tensor = random_tensor((2, 40, 32), seed=11)
    tensor[..., 5] *= 60  # an outlier channel, as trained keys have
    coding = TensorCoding(spec)
    parts = coding.parts_of("layers.3.key", tensor)
    assert set(parts) == {"layers.3.key#columns", "layers.3.key#scale",
                          "layers.3.key#" + ("fp8" if coding.method == "fp8" else f"int{coding.bits}")}
    columns = parts["layers.3.key#columns"].float()
    assert parts["layers.3.key#columns"].dtype == torch.bfloat16 and columns.shape == (2, 32)
    decoded = decompress_entry(parts, None, torch.float32)["layers.3.key"]
    equalized = tensor / columns.unsqueeze(-2)
    if coding.method == "int":
        expected = naive.round_trip_int(equalized, coding.bits, group_size(32, coding.group))
    else:
        expected = naive.round_trip_float8(equalized, group_size(32, coding.group))
    torch.testing.assert_close(decoded, expected * columns.unsqueeze(-2), rtol=1e-6, atol=0)
    plain = decompress_entry(TensorCoding(spec.removesuffix("+cols")).parts_of("layers.3.key", tensor), None,
                             torch.float32)["layers.3.key"]
    ordinary = ~torch.isin(torch.arange(32), torch.tensor([5]))
    if coding.method == "int":  # a uniform grid: the outlier's range no longer sets the others' step
        assert float((decoded - tensor)[..., ordinary].abs().mean()) < 0.5 * float((plain - tensor)[..., ordinary].abs().mean())


@pytest.mark.parametrize("name", ["int7-kv8", "int4", "fp8"])
def test_entries_decoded_together_equal_each_decoded_alone(name: str) -> None:
    """`decompress_entries` expands every coding once for all the entries (chunks of other lengths, all layers):
    the same values, names, order and dtypes as one entry at a time, and float32 entries pass through unchanged."""
    from hypic_rag.entry.compression import decompress_entries

    entries = [synthetic_entry(TINY_SHAPE, list(range(start, start + length)), seed=start)
               for start, length in ((0, 24), (100, 40), (200, 8))]
    stored = [compress_entry(entry, name) for entry in entries] + [entries[0]]
    together = decompress_entries(stored, "cpu", torch.bfloat16)
    assert torch.equal(together[-1]["layers.0.suffix_state"], entries[0]["layers.0.suffix_state"])
    assert together[-1]["layers.3.key"].dtype == torch.bfloat16  # a float32 entry's K/V in the model's dtype
    for alone_stored, decoded in zip(stored[:-1], together[:-1]):
        alone = decompress_entry(alone_stored, "cpu", torch.bfloat16)
        assert list(decoded) == list(alone)
        for tensor_name, tensor in alone.items():
            assert decoded[tensor_name].dtype == tensor.dtype and torch.equal(decoded[tensor_name], tensor), tensor_name


def test_conv_tails_are_grouped_along_their_channels() -> None:
    """`transpose` (conv tails of the group formats): [C, kernel - 1] is grouped over C (a 3-wide row has no group),
    matching the reference on the transposed tensor, and decodes to the original layout."""
    tensor = random_tensor((256, 3), seed=4)
    parts = TensorCoding("int8/128", transpose=True).parts_of("layers.0.conv_tail", tensor)
    assert parts["layers.0.conv_tail#int8.t"].shape == (3, 2, 128) and parts["layers.0.conv_tail#scale"].shape == (3, 2)
    decoded = decompress_entries_for_test(parts)["layers.0.conv_tail"]
    assert decoded.shape == (256, 3) and decoded.is_contiguous()
    assert torch.equal(decoded, naive.round_trip_int(tensor.t().contiguous(), 8, 128).t())
    assert TensorCoding("int8/128").parts_of("layers.0.conv_tail", tensor)["layers.0.conv_tail"].dtype == torch.float16
    both = TensorCoding("int8/128+cols", transpose=True).parts_of("layers.0.conv_tail", tensor)  # evened, transposed
    assert both["layers.0.conv_tail#columns"].shape == (256,)
    assert float((decompress_entries_for_test(both)["layers.0.conv_tail"] - tensor).abs().max()) < 0.02 * float(
        tensor.abs().max())
    stored = compress_entry(synthetic_entry(TINY_SHAPE, list(range(12)), seed=1), "int7-kv8")
    assert {"layers.0.conv_tail#int8.t", "layers.0.suffix_state#int7", "layers.3.key#int8", "layers.3.key#columns"} <= set(stored)


def decompress_entries_for_test(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One stored form decoded twice in one call (both copies share every expansion); the second."""
    from hypic_rag.entry.compression import decompress_entries

    return decompress_entries([stored, stored], "cpu", torch.float32)[1]
