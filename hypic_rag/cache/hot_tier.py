"""In-process hot tier above the disk store: decoded entries, least recently used evicted past a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

import torch


def tensor_bytes(entry: Mapping[str, torch.Tensor]) -> int:
    """Bytes held by an entry's tensors."""
    return sum(tensor.numel() * tensor.element_size() for tensor in entry.values())


class HotTier:
    """LRU map key -> decoded entry (``dict[str, torch.Tensor]``) holding at most `budget_bytes` of tensors.

    Entries are shared, not copied: `get` returns a new dict over the same tensors, which callers must not
    modify in place. An entry larger than the whole budget is not kept. Thread-safe.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"hot tier budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, tuple[dict[str, torch.Tensor], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    def get(self, key: bytes) -> dict[str, torch.Tensor] | None:
        """The entry under `key` (now most recently used), or None."""
        with self._lock:
            item = self._entries.get(key)
            if item is None:
                return None
            self._entries.move_to_end(key)
            return dict(item[0])

    def put(self, key: bytes, entry: Mapping[str, torch.Tensor]) -> bool:
        """Keep `entry` (replacing any under `key`), evicting least recently used ones; False if too large."""
        size = tensor_bytes(entry)
        with self._lock:
            self._discard(key)
            if size > self.budget_bytes:
                return False
            while self._bytes + size > self.budget_bytes and self._entries:
                _, (_, evicted_size) = self._entries.popitem(last=False)
                self._bytes -= evicted_size
                self.evictions += 1
            self._entries[key] = (dict(entry), size)
            self._bytes += size
            return True

    def remove(self, key: bytes) -> bool:
        with self._lock:
            return self._discard(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def _discard(self, key: bytes) -> bool:
        item = self._entries.pop(key, None)
        if item is None:
            return False
        self._bytes -= item[1]
        return True
