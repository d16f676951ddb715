"""In-process LRU maps with a byte budget: segment entries (when no persistent cache is configured) and the
chunk-boundary checkpoints of `prefix` mode."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")


class ByteBudgetLRU(Generic[Value]):
    """Least-recently-used map evicting the oldest values once their summed size exceeds `budget_bytes`."""

    def __init__(self, budget_bytes: int, size_of: Callable[[Value], int]) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[Value, int]] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> Value | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, value: Value) -> None:
        size = self._size_of(value)
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        if size > self.budget_bytes:
            return
        self._items[key] = (value, size)
        self.bytes += size
        while self.bytes > self.budget_bytes:
            _, (_, evicted) = self._items.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1
