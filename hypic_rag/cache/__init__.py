"""Persistent segment cache: chunk entries encoded once, reused across requests, restarts and processes.

`SegmentCache` (hot tier over an LMDB store) is what the runtime uses; `CacheNamespace` keys it.
See docs/cache.md.
"""

from hypic_rag.cache.errors import CacheError, CacheOpenError, CorruptEntryError, IncompatibleEntryError
from hypic_rag.cache.keys import FORMAT_VERSION, STATE_DTYPES, CacheNamespace, segment_key

__all__ = [
    "FORMAT_VERSION",
    "STATE_DTYPES",
    "CacheError",
    "CacheNamespace",
    "CacheOpenError",
    "CorruptEntryError",
    "IncompatibleEntryError",
    "segment_key",
]
