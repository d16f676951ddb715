"""Handing memory the allocator holds but no longer uses back to the operating system.

glibc's malloc keeps what a process freed in its arenas (one per thread that allocated, up to 8 per core) and
returns it to the system only from the top of each heap: after a burst of requests served by many threads, the
freed tensors of a model worker stay resident, scattered over the arenas, and the next burst's allocations land
elsewhere. `malloc_trim(0)` walks every arena and releases the free pages inside them (docs/service.md, "Memory
under bursts", has the measurement). Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_MALLOC_TRIM: ctypes._CFuncPtr | None | bool = False  # False: not looked up yet; None: not glibc


def _malloc_trim() -> ctypes._CFuncPtr | None:
    global _MALLOC_TRIM
    if _MALLOC_TRIM is False:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            function = libc.malloc_trim
            function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
            _MALLOC_TRIM = function
        except (OSError, AttributeError):
            _MALLOC_TRIM = None
    return _MALLOC_TRIM  # type: ignore[return-value]


def release_free_memory() -> bool:
    """Return the allocator's free pages to the system (glibc `malloc_trim(0)`); whether any were released (False
    where there is no glibc). Costs a walk over the heaps: call it when idle, not per request."""
    function = _malloc_trim()
    if function is None:
        return False
    return bool(function(0))
