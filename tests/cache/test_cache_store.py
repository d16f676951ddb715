"""The LMDB segment store on real LMDB files: round trips, durability across reopen, budget and LRU eviction,
map growth, and refusal of directories that are not (or cannot be) a cache."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest

from hypic_rag.cache.errors import CacheError, CacheOpenError
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.store import PutRequest

MIB = 1 << 20


def key(name: str) -> bytes:
    return name.encode().ljust(48, b".")


def value(seed: int, size: int) -> bytes:
    return (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]


def test_round_trip_persists_across_reopen(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path / "c", budget_bytes=64 * MIB) as store:
        assert store.put(PutRequest(key("a"), value(1, 1000), linear_bytes=600, kv_bytes=300))
        assert store.batched_put([PutRequest(key("b"), value(2, 5000)), PutRequest(key("c"), b"")]) == [True, True]
        assert store.get(key("a")) == value(1, 1000)
        assert store.batched_contains([key("a"), key("zz")]) == [True, False]
    with LmdbSegmentStore.open(tmp_path / "c") as store:  # budget remembered
        assert store.budget_bytes == 64 * MIB
        assert store.batched_get([key("b"), key("c"), key("zz")]) == [value(2, 5000), b"", None]
        counters = store.counters()
        assert (counters.entries, counters.value_bytes, counters.linear_bytes, counters.kv_bytes) == (3, 6000, 600, 300)
        assert store.remove(key("b")) and not store.remove(key("b"))
        assert sorted(store.keys()) == [key("a"), key("c")]
        assert store.counters().value_bytes == 1000
        assert store.clear() == 2
        assert list(store.keys()) == [] and store.counters().entries == 0


def test_replacing_a_key_keeps_totals_right(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=64 * MIB) as store:
        store.put(PutRequest(key("a"), value(1, 3000), kv_bytes=100))
        store.put(PutRequest(key("a"), value(2, 700), kv_bytes=50))
        counters = store.counters()
        assert (counters.entries, counters.value_bytes, counters.kv_bytes) == (1, 700, 50)
        assert store.get(key("a")) == value(2, 700)
        assert len(store.lru_order()) == 1


def test_filling_past_the_budget_evicts_least_recently_used_and_keeps_serving(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=4 * MIB + MIB // 2) as store:
        for name in "abcd":
            assert store.put(PutRequest(key(name), value(ord(name), MIB)))
        assert store.get(key("a")) is not None  # a is now more recent than b, c, d
        store.put(PutRequest(key("e"), value(5, MIB)))
        store.put(PutRequest(key("f"), value(6, MIB)))
        assert [name for name in "abcdef" if store.contains(key(name))] == ["a", "d", "e", "f"]
        counters = store.counters()
        assert counters.evictions == 2 and counters.value_bytes <= store.budget_bytes
        assert store.get(key("f")) == value(6, MIB)
    with LmdbSegmentStore.open(tmp_path) as store:  # the recency of "a" was written durably
        assert store.lru_order()[-1] == key("f") and store.lru_order()[0] == key("d")


def test_an_entry_larger_than_the_budget_is_skipped_not_raised(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=MIB) as store:
        store.put(PutRequest(key("small"), value(1, 1000)))
        assert store.put(PutRequest(key("huge"), value(2, 2 * MIB))) is False
        assert store.contains(key("small")) and not store.contains(key("huge"))
        assert store.counters().skipped_puts == 1


def test_the_map_grows_instead_of_failing(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=256 * MIB, initial_map_bytes=MIB) as store:
        first_map = store.info()["map_bytes"]
        assert store.batched_put([PutRequest(key(str(i)), value(i, MIB)) for i in range(12)]) == [True] * 12
        assert store.info()["map_bytes"] > first_map
        assert all(store.get(key(str(i))) == value(i, MIB) for i in range(12))


def test_at_the_map_cap_puts_evict_and_keep_succeeding(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=1 << 40, initial_map_bytes=MIB, max_map_bytes=6 * MIB) as store:
        for i in range(30):
            assert store.put(PutRequest(key(str(i)), value(i, MIB // 2)))
            assert store.get(key(str(i))) == value(i, MIB // 2)
        counters = store.counters()
        assert counters.evictions > 0 and counters.entries == 30 - counters.evictions
        assert store.info()["map_bytes"] <= 6 * MIB + 64 * MIB  # at most one step past the cap, never a failure


def test_lookup_counters_are_shared_through_the_store(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=MIB) as store:
        store.record_lookups(hits=3, misses=2, corrupt=1, mismatched=1)
        assert store.counters().hits == 3  # pending ones are included before they are written
    with LmdbSegmentStore.open(tmp_path, readonly=True) as store:
        counters = store.counters()
        assert (counters.hits, counters.misses, counters.corrupt, counters.mismatched) == (3, 2, 1, 1)


def test_read_only_store_reads_but_refuses_writes(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=MIB) as store:
        store.put(PutRequest(key("a"), b"xyz"))
    with LmdbSegmentStore.open(tmp_path, readonly=True) as store:
        assert store.get(key("a")) == b"xyz"
        with pytest.raises(CacheError, match="read-only"):
            store.put(PutRequest(key("b"), b"1"))


def test_bad_directories_give_one_line_errors(tmp_path: Path) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a cache")
    not_lmdb = tmp_path / "not_lmdb"
    not_lmdb.mkdir()
    (not_lmdb / "data.mdb").write_bytes(os.urandom(8192))
    busy = tmp_path / "unrelated"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    foreign = tmp_path / "foreign"
    with lmdb.open(str(foreign), max_dbs=2) as env:
        env.open_db(b"other")
    cases = [
        (lambda: LmdbSegmentStore.open(tmp_path / "missing", readonly=True), "no cache directory"),
        (lambda: LmdbSegmentStore.open(tmp_path / "missing2", create=False), "no cache directory"),
        (lambda: LmdbSegmentStore.open(a_file), "not a directory"),
        (lambda: LmdbSegmentStore.open(not_lmdb), "not an LMDB store"),
        (lambda: LmdbSegmentStore.open(not_lmdb, readonly=True), "not an LMDB store"),
        (lambda: LmdbSegmentStore.open(busy), "not empty"),
        (lambda: LmdbSegmentStore.open(foreign), "not a hypic-rag cache"),
    ]
    for open_store, message in cases:
        with pytest.raises(CacheOpenError, match=message) as raised:
            open_store()
        assert "\n" not in str(raised.value)
    assert not (not_lmdb / "lock.mdb").exists()  # refused before LMDB touched the directory


def test_a_second_open_in_the_same_process_is_refused_clearly(tmp_path: Path) -> None:
    with LmdbSegmentStore.open(tmp_path, budget_bytes=MIB):
        with pytest.raises(CacheOpenError, match="already open"):
            LmdbSegmentStore.open(tmp_path)
