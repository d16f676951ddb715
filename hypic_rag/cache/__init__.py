"""Persistent segment cache: chunk entries encoded once, reused across requests, restarts and processes.

- `keys`: `CacheNamespace` and key derivation;  `codec`: entry <-> bytes;  `layout`: what each tensor is.
- `store`: the `SegmentStore` interface;  `lmdb_store`: its LMDB implementation;  `hot_tier`: in-memory LRU.
- `segment_cache`: `SegmentCache`, what the runtime uses;  `stats`, `maintenance`: statistics, verify and gc.

Nothing is imported here, so that the storage modules load without torch (see docs/cache.md).
"""
