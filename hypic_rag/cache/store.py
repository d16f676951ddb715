"""The storage interface of the segment cache: opaque byte values under fixed-size keys (LMCache-style).

A store knows nothing about tensors; `segment_cache.SegmentCache` puts encoded entries (see `codec`) in it.
Each put carries a small size breakdown of its value (linear-state and K/V bytes) so the store can keep running
totals for statistics without decoding anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
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
    """

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
    def evict_to(self, budget_bytes: int) -> int:
        """Evict least-recently-used values until the stored bytes fit `budget_bytes`; the number evicted."""

    @abstractmethod
    def clear(self) -> int:
        """Remove every value; the number removed."""

    @abstractmethod
    def close(self) -> None:
        """Write pending access records and release the store."""
