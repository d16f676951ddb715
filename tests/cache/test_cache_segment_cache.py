"""SegmentCache on real LMDB files with entries shaped like the runtime's: hits, misses, namespaces, corruption,
cache formats and the hot tier."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from hypic_rag.cache.codec import encode_entry
from hypic_rag.cache.errors import CacheOpenError
from hypic_rag.cache.keys import FORMAT_VERSION, CacheNamespace, segment_key
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cache.store import PutRequest
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.entry.compression import compress_entry, decompress_entry

NS = CacheNamespace(model_fingerprint="model-a", tokenizer_fingerprint="tok-a", seam_tokens=8)
MIB = 1 << 20


class CountingEncoder:
    """Deterministic stand-in for `Engine.encode_segment`; records every call."""

    def __init__(self, salt: int = 0) -> None:
        self.salt = salt
        self.calls: list[list[list[int]]] = []

    def entry(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        return synthetic_entry(TINY_SHAPE, ids, seed=hash((self.salt, *ids)) % (2**31))

    def one(self, ids: list[int]) -> dict[str, torch.Tensor]:
        self.calls.append([list(ids)])
        return self.entry(ids)

    def many(self, missing: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        self.calls.append([list(ids) for ids in missing])
        return [self.entry(ids) for ids in missing]


def assert_bit_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(actual[name], expected[name]), name


def flip_byte_on_disk(directory: Path, stored_value: bytes, position: int) -> None:
    """Damage one byte of a stored value inside data.mdb, as bit rot would (LMDB itself does not notice)."""
    data_file = directory / "data.mdb"
    data = bytearray(data_file.read_bytes())
    start = data.find(stored_value[:256])
    assert start >= 0 and data.find(stored_value[:256], start + 1) < 0, "value not found exactly once"
    data[start + position] ^= 0x5A
    data_file.write_bytes(bytes(data))


def test_miss_then_hit_is_bit_exact_and_survives_reopen(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        first, hit = cache.get_or_encode(NS, [3, 1, 4, 1, 5], encoder.one)
        assert not hit
        second, hit = cache.get_or_encode(NS, [3, 1, 4, 1, 5], encoder.one)
        assert hit and len(encoder.calls) == 1
        assert_bit_equal(second, first)
        assert cache.stats()["hot_hits"] == 1
    with SegmentCache.open(tmp_path) as cache:  # a new hot tier: served from disk
        third, hit = cache.get_or_encode(NS, [3, 1, 4, 1, 5], encoder.one)
        assert hit and len(encoder.calls) == 1
        assert_bit_equal(third, encoder.entry([3, 1, 4, 1, 5]))
        stats = cache.stats()
        assert stats["disk_hits"] == 1 and stats["hits"] == 2 and stats["misses"] == 1
        assert stats["kv_bytes_per_entry"] == 2 * 2 * 5 * 16 * 4  # key + value, [2 heads, 5 tokens, 16] fp32


def test_many_encodes_only_distinct_misses_in_one_call(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    chunks = [[1, 2], [3, 4, 5], [1, 2], [6], [3, 4, 5]]
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        cache.get_or_encode(NS, [6], encoder.one)
        entries, hits = cache.get_or_encode_many(NS, chunks, encoder.many)
        assert hits == [False, False, False, True, False]
        assert encoder.calls[1] == [[1, 2], [3, 4, 5]]  # one call, each missing chunk once
        for ids, entry in zip(chunks, entries):
            assert entry["token_ids"].tolist() == ids
        assert cache.stats()["entries"] == 3
        _, hits = cache.get_or_encode_many(NS, chunks, encoder.many)
        assert hits == [True] * 5 and len(encoder.calls) == 2


@pytest.mark.parametrize("cache_format", ["float32", "int8", "int4"])
def test_a_flipped_byte_on_disk_is_detected_recomputed_and_replaced(tmp_path: Path, caplog, cache_format: str) -> None:
    """Also for compressed entries: a flipped bit in packed codes or a scale fails the crc32 like any other."""
    namespace = dataclasses.replace(NS, cache_format=cache_format)
    encoder = CountingEncoder()
    ids = list(range(30))
    expected = compress_entry(encoder.entry(ids), cache_format)
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        cache.get_or_encode(namespace, ids, encoder.one)
        stored = bytes(cache.store.get(segment_key(namespace, ids), touch=False))
    flip_byte_on_disk(tmp_path, stored, len(stored) - 20)  # inside the last K/V tensor (its codes or scales)
    with SegmentCache.open(tmp_path) as cache, caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
        entry, hit = cache.get_or_encode(namespace, ids, encoder.one)
        assert not hit and len(encoder.calls) == 2  # recomputed
        assert_bit_equal(entry, expected)  # the correct answer
        assert any("corrupt cache entry" in record.getMessage() for record in caplog.records)
        assert cache.stats()["corrupt"] == 1
        assert bytes(cache.store.get(segment_key(namespace, ids), touch=False)) == stored  # replaced by a good copy
    with SegmentCache.open(tmp_path) as cache:
        _, hit = cache.get_or_encode(namespace, ids, encoder.one)
        assert hit and cache.stats()["corrupt"] == 1


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "model-b"},
        {"tokenizer_fingerprint": "tok-b"},
        {"seam_tokens": 2},
        {"cache_format": "int8"},
        {"format_version": FORMAT_VERSION + 1},
    ],
)
def test_an_entry_of_another_namespace_is_never_returned(tmp_path: Path, change: dict) -> None:
    other_ns = dataclasses.replace(NS, **change)
    ids = [7, 8, 9, 10]
    ours, theirs = CountingEncoder(salt=1), CountingEncoder(salt=2)
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as writer:
        writer.get_or_encode(other_ns, ids, theirs.one)
    with SegmentCache.open(tmp_path) as cache:
        entry, hit = cache.get_or_encode(NS, ids, ours.one)
        assert not hit
        assert_bit_equal(entry, ours.entry(ids))
        # even planted under our key (a digest collision, a copied file), their entry is refused by its header
        their_value = cache.store.get(segment_key(other_ns, ids), touch=False)
        cache.store.put(PutRequest(segment_key(NS, ids), their_value))
        cache.hot_tier.clear()
        entry, hit = cache.get_or_encode(NS, ids, ours.one)
        assert not hit and cache.stats()["mismatched"] == 1
        assert_bit_equal(entry, ours.entry(ids))


def test_stored_token_ids_must_equal_the_request(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        impostor = encoder.entry([1, 2, 3])
        cache.store.put(PutRequest(segment_key(NS, [4, 5, 6]), encode_entry(impostor, NS.canonical())))
        entry, hit = cache.get_or_encode(NS, [4, 5, 6], encoder.one)
        assert not hit and entry["token_ids"].tolist() == [4, 5, 6]
        assert cache.stats()["mismatched"] == 1


@pytest.mark.parametrize("cache_format", ["float16", "int8", "int4"])
def test_a_compressed_format_shrinks_entries_and_a_miss_equals_a_hit(tmp_path: Path, cache_format: str) -> None:
    """Entries come back in their stored form, the same on a miss and on a hit (answers do not depend on whether
    the cache was warm), decode near the float32 entry, and take fewer bytes of linear state and of K/V."""
    encoder = CountingEncoder()
    ids = list(range(16))
    compressed_ns = dataclasses.replace(NS, cache_format=cache_format)
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        full, _ = cache.get_or_encode(NS, ids, encoder.one)
        on_miss, _ = cache.get_or_encode(compressed_ns, ids, encoder.one)
    with SegmentCache.open(tmp_path) as cache:
        on_hit, hit = cache.get_or_encode(compressed_ns, ids, encoder.one)
        assert hit
        assert_bit_equal(on_hit, on_miss)  # same answer whether the cache was warm or not
        assert_bit_equal(on_hit, compress_entry(full, cache_format))
        decoded = decompress_entry(on_hit, "cpu", torch.float32)
        assert decoded["layers.0.transition"].dtype == torch.float32
        assert not torch.equal(decoded["layers.0.transition"], full["layers.0.transition"])  # rounded
        tolerance = 0.3 if cache_format == "int4" else 0.05
        torch.testing.assert_close(decoded["layers.0.suffix_state"], full["layers.0.suffix_state"], atol=tolerance,
                                   rtol=0.02)
        torch.testing.assert_close(decoded["layers.3.key"], full["layers.3.key"], atol=tolerance, rtol=0.02)
        records = {bytes(k): cache.store.record(k) for k in cache.store.keys()}
        compressed = records[segment_key(compressed_ns, ids)]
        reference = records[segment_key(NS, ids)]
        assert compressed.kv_bytes < reference.kv_bytes
        assert compressed.linear_bytes < reference.linear_bytes and compressed.value_bytes < reference.value_bytes


def test_hot_tier_serves_repeats_without_disk_and_evicts_by_bytes(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    entry_size = sum(t.numel() * t.element_size() for t in encoder.entry(list(range(10))).values())
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB, hot_budget_bytes=2 * entry_size + 10) as cache:
        for start in (0, 100, 200):
            cache.get_or_encode(NS, list(range(start, start + 10)), encoder.one)
        assert len(cache.hot_tier) == 2 and cache.hot_tier.bytes <= cache.hot_tier.budget_bytes
        cache.store.remove(segment_key(NS, list(range(200, 210))))  # gone from disk, still hot
        entry, hit = cache.get_or_encode(NS, list(range(200, 210)), encoder.one)
        assert hit and cache.stats()["hot_hits"] == 1
        entry["token_ids"] = torch.tensor([0])  # callers may rebind names in the dict they get...
        again, _ = cache.get_or_encode(NS, list(range(200, 210)), encoder.one)
        assert again["token_ids"].tolist() == list(range(200, 210))  # ...without affecting the cache
        _, hit = cache.get_or_encode(NS, list(range(10)), encoder.one)  # evicted from hot, served from disk
        assert hit and cache.stats()["disk_hits"] == 1


def test_read_only_cache_computes_misses_without_storing(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        cache.get_or_encode(NS, [1], encoder.one)
    with SegmentCache.open(tmp_path, readonly=True) as cache:
        assert cache.get_or_encode(NS, [1], encoder.one)[1]
        entry, hit = cache.get_or_encode(NS, [2], encoder.one)
        assert not hit and entry["token_ids"].tolist() == [2]
        assert cache.stats()["entries"] == 1


def test_an_encoder_returning_the_wrong_chunk_is_an_error_and_stores_nothing(tmp_path: Path) -> None:
    encoder = CountingEncoder()
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        with pytest.raises(ValueError, match="token_ids"):
            cache.get_or_encode(NS, [1, 2], lambda ids: encoder.entry([9, 9]))
        with pytest.raises(ValueError, match="2 entries for 1"):
            cache.get_or_encode_many(NS, [[5]], lambda missing: [encoder.entry([5])] * 2)
        assert cache.stats()["entries"] == 0


def test_open_errors_are_cache_open_errors(tmp_path: Path) -> None:
    with pytest.raises(CacheOpenError, match="no cache directory"):
        SegmentCache.open(tmp_path / "missing", readonly=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheOpenError, match="not a directory"):
        SegmentCache.open(tmp_path / "file")


def test_warnings_name_each_corrupt_entry_apart(tmp_path: Path, caplog) -> None:
    """Two corrupt entries of one namespace are named differently (a key's first bytes are its namespace's)."""
    encoder = CountingEncoder()
    chunks = [list(range(30)), list(range(40, 70))]
    with SegmentCache.open(tmp_path, disk_budget_bytes=64 * MIB) as cache:
        cache.get_or_encode_many(NS, chunks, encoder.many)
        stored = [bytes(cache.store.get(segment_key(NS, ids), touch=False)) for ids in chunks]
    for value in stored:
        flip_byte_on_disk(tmp_path, value, len(value) - 100)
    with SegmentCache.open(tmp_path) as cache, caplog.at_level(logging.WARNING, logger="hypic_rag.cache"):
        cache.get_or_encode_many(NS, chunks, encoder.many)
    named = {record.getMessage().split()[3] for record in caplog.records
             if record.getMessage().startswith("corrupt cache entry")}
    assert len(named) == 2, caplog.messages
