"""Persistent segment cache: chunk entries encoded once, reused across requests, restarts and processes.

- `keys`: `CacheNamespace` and key derivation;  `codec`: entry <-> bytes. The entry format itself is
  `hypic_rag.entry.schema` and the cache formats entries are stored in `hypic_rag.entry`, both shared with the
  runtime (which imports nothing from here).
- `store`: the `SegmentStore` interface;  `lmdb_store`: its LMDB implementation;  `hot_tier`: in-memory LRU.
- `segment_cache`: `SegmentCache`, the runtime's persistent `SegmentSource`;
  `stats`, `maintenance`: statistics, verify and gc.

Nothing is imported here, so that the storage modules load without torch (see docs/cache.md).
"""
