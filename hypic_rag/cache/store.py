"""The storage interface of the segment cache: opaque byte values under fixed-size keys (LMCache-style).

A store knows nothing about tensors; `segment_cache.SegmentCache` puts encoded entries (see `codec`) in it.
`SegmentStore` is the interface the rest of the code is typed against (`lmdb_store.LmdbSegmentStore` on disk,
`NullStore` in place of a damaged one); code outside the cache reaches a store only through `SegmentCache`.
Each put carries a small size breakdown of its value (linear-state and K/V bytes) so the store can keep running
totals for statistics without decoding anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple


class PutRequest(NamedTuple):
    """One value to store. linear_bytes / kv_bytes: how much of `value` is linear state / K/V (for statistics)."""

    key: bytes
    value: bytes | bytearray | memoryview
    linear_bytes: int = 0
    kv_bytes: int = 0


@dataclass(slots=True)
class StoreCounters:
    """Persistent totals of a store (shared by every process using it).

    hits / misses / corrupt / mismatched are reported to the store by its users (`record_lookups`),
    evictions and skipped_puts by the store itself.
    """

    entries: int = 0
    value_bytes: int = 0
    linear_bytes: int = 0
    kv_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    mismatched: int = 0
    skipped_puts: int = 0


class SegmentStore(ABC):
    """A key -> bytes store with a byte budget and least-recently-used eviction.

    Reads return a private copy of the value (a bytearray), never a view that storage may reuse.

    path: where the store lives; readonly: writes are refused (or dropped); budget_bytes: the byte budget.
    """

    path: Path
    readonly: bool
    budget_bytes: int

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True if `key` is stored (does not count as an access)."""

    @abstractmethod
    def get(self, key: bytes, *, touch: bool = True) -> bytearray | None:
        """The value under `key`, or None; counts as an access for LRU unless `touch` is False."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Note an access to `keys` without reading them (for LRU); a no-op unless the store tracks recency."""

    @abstractmethod
    def put(self, request: PutRequest) -> bool:
        """Store (or replace) one value durably; False if it was skipped (larger than the whole budget)."""

    @abstractmethod
    def remove(self, key: bytes) -> bool:
        """Delete `key`; True if it was there."""

    def batched_contains(self, keys: Sequence[bytes]) -> list[bool]:
        """`contains` for each key."""
        return [self.contains(key) for key in keys]

    def batched_get(self, keys: Sequence[bytes], *, touch: bool = True) -> list[bytearray | None]:
        """`get` for each key (implementations read them in one snapshot)."""
        return [self.get(key, touch=touch) for key in keys]

    def batched_put(self, requests: Iterable[PutRequest]) -> list[bool]:
        """`put` for each request (implementations commit them in one transaction: all or none)."""
        return [self.put(request) for request in requests]

    def batched_remove(self, keys: Sequence[bytes]) -> int:
        """`remove` for each key; the number removed."""
        return sum(self.remove(key) for key in keys)

    def value_bytes(self, key: bytes) -> int | None:
        """Bytes of the value stored under `key` (None: not stored), without counting as an access."""
        value = self.get(key, touch=False)
        return None if value is None else len(value)

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every stored key (a snapshot; order unspecified)."""

    @abstractmethod
    def record_lookups(self, *, hits: int = 0, misses: int = 0, corrupt: int = 0, mismatched: int = 0) -> None:
        """Add lookup outcomes of this process to the persistent counters (may be batched before writing)."""

    @abstractmethod
    def counters(self) -> StoreCounters:
        """The persistent totals, including this process's not yet written lookups."""

    @abstractmethod
    def info(self) -> dict[str, int | str | bool]:
        """Facts about the storage: at least path, readonly, budget_bytes, map_bytes and file_bytes."""

    def flush(self) -> None:
        """Write pending access notes and lookup counts now (a no-op unless the store batches them)."""

    @abstractmethod
    def evict_to(self, budget_bytes: int) -> int:
        """Evict least-recently-used values until the stored bytes fit `budget_bytes`; the number evicted."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every value; the number removed."""

    @abstractmethod
    def close(self) -> None:
        """Write pending access records and release the store."""


class NullStore(SegmentStore):
    """A store that holds nothing: every lookup misses and writes are dropped (it is read-only).

    `SegmentCache.open(..., best_effort=True)` puts it in place of a disk store that cannot be used safely
    (`CacheDamagedError`), so answers go on, computed without the disk tier. `reason` says why; lookup
    outcomes are counted in memory.
    """

    readonly = True

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        self.budget_bytes = 0
        self._counters = StoreCounters()

    def contains(self, key: bytes) -> bool:
        return False

    def get(self, key: bytes, *, touch: bool = True) -> bytearray | None:
        return None

    def put(self, request: PutRequest) -> bool:
        return False

    def remove(self, key: bytes) -> bool:
        return False

    def keys(self) -> Iterator[bytes]:
        return iter(())

    def record_lookups(self, *, hits: int = 0, misses: int = 0, corrupt: int = 0, mismatched: int = 0) -> None:
        self._counters.hits += hits
        self._counters.misses += misses
        self._counters.corrupt += corrupt
        self._counters.mismatched += mismatched

    def counters(self) -> StoreCounters:
        return replace(self._counters)

    def info(self) -> dict[str, int | str | bool]:
        """The fields `LmdbSegmentStore.info` gives, all zero: no file is mapped."""
        return {"path": str(self.path), "readonly": True, "budget_bytes": 0, "map_bytes": 0, "max_map_bytes": 0,
                "file_bytes": 0, "used_bytes": 0, "readers": 0}

    def evict_to(self, budget_bytes: int) -> int:
        return 0

    def clear(self) -> int:
        return 0

    def flush(self) -> None:
        """Nothing to write."""

    def close(self) -> None:
        """Nothing to release."""
