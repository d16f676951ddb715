"""On-disk bookkeeping of the LMDB segment store: per-entry records, the LRU index and the counters.

Sub-databases of the environment (besides ``entries``: key -> encoded value):

- ``records``: key -> `EntryRecord` packed as four little-endian u64 (last access ns, value bytes, linear bytes,
  K/V bytes); written with the value in the same transaction, so totals can be kept without decoding.
- ``lru``: big-endian u64 last access ns + key -> b""; LMDB keeps keys sorted, so the first item is the least
  recently used entry. Updated together with ``records`` (delete the old index item, insert the new one).
- ``meta``: counter name -> little-endian u64, plus ``schema`` (identifies a hypic-rag store) and ``budget_bytes``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Any

from hypic_rag.cache.store import StoreCounters

SCHEMA = b"hypic-rag segment store 1"
SCHEMA_KEY = b"schema"
BUDGET_KEY = b"budget_bytes"
SUB_DATABASES = (b"entries", b"records", b"lru", b"meta")

_RECORD = struct.Struct("<QQQQ")
_ACCESS = struct.Struct(">Q")
_COUNTER = struct.Struct("<Q")
COUNTER_NAMES = tuple(field.name for field in fields(StoreCounters))


@dataclass(frozen=True, slots=True)
class EntryRecord:
    """What the store knows of one entry without reading it."""

    last_access_ns: int
    value_bytes: int
    linear_bytes: int
    kv_bytes: int

    def pack(self) -> bytes:
        return _RECORD.pack(self.last_access_ns, self.value_bytes, self.linear_bytes, self.kv_bytes)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> EntryRecord:
        return cls(*_RECORD.unpack(raw))


def lru_key(last_access_ns: int, key: bytes) -> bytes:
    """Index key ordering entries by last access (oldest first), ties by entry key."""
    return _ACCESS.pack(last_access_ns) + key


def entry_key_of_lru_key(index_key: bytes) -> bytes:
    return bytes(index_key[_ACCESS.size :])


def pack_u64(value: int) -> bytes:
    return _COUNTER.pack(max(0, value))


def unpack_u64(raw: bytes | memoryview | None) -> int:
    return 0 if raw is None else _COUNTER.unpack(raw)[0]


def read_counters(txn: Any, meta_db: Any) -> StoreCounters:
    """The counters as stored in `meta_db`, read in `txn`."""
    return StoreCounters(**{name: unpack_u64(txn.get(name.encode(), db=meta_db)) for name in COUNTER_NAMES})


def write_counters(txn: Any, meta_db: Any, counters: StoreCounters) -> None:
    """Store every counter in `meta_db` within the write `txn`."""
    for name in COUNTER_NAMES:
        txn.put(name.encode(), pack_u64(getattr(counters, name)), db=meta_db)
