"""A thread-safe least-recently-used map with a byte budget, shared by every in-process cache: the segment
cache's hot tier, the runtime's `MemorySegmentSource` (entries when no persistent cache is given) and `prefix` mode's
checkpoints."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class ByteBudgetLRU(Generic[Value]):
    """Values evicted oldest-first once their summed `size_of` exceeds `budget_bytes`; a value larger than the
    whole budget is not kept."""

    def __init__(self, budget_bytes: int, size_of: Callable[[Value], int]) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[Value, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: Hashable) -> Value | None:
        """The value under `key` (now most recently used), or None."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: Value) -> bool:
        """Keep `value` (replacing any under `key`), evicting least recently used ones; False if too large."""
        size = self._size_of(value)
        with self._lock:
            self._discard(key)
            if size > self.budget_bytes:
                return False
            while self._bytes + size > self.budget_bytes and self._items:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted
                self.evictions += 1
            self._items[key] = (value, size)
            self._bytes += size
            return True

    def remove(self, key: Hashable) -> bool:
        with self._lock:
            return self._discard(key)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def _discard(self, key: Hashable) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self._bytes -= item[1]
        return True
