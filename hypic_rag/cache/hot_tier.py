"""In-process hot tier above the disk store: entries as stored (decoded from their bytes, still in their cache
format), least recently used evicted past a byte budget."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hypic_rag.entry.schema import Entry, entry_tensor_bytes
from hypic_rag.utils.lru import ByteBudgetLRU


class HotTier(ByteBudgetLRU[Entry]):
    """LRU map key -> entry in its stored form (an `Entry`) holding at most `budget_bytes` of tensors (a compressed
    format's codes and scales: such a tier holds more entries).

    Entries are shared, not copied: `get` returns a new dict over the same tensors, which callers must not
    modify in place. An entry larger than the whole budget is not kept. Thread-safe.
    """

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes, entry_tensor_bytes)

    def get(self, key: bytes) -> Entry | None:
        entry = super().get(key)
        return None if entry is None else dict(entry)

    def put(self, key: bytes, entry: Mapping[str, torch.Tensor]) -> bool:
        return super().put(key, dict(entry))
