"""A segment source handing out another source's entries in a compressed cache format's stored form, without
building a cache in that format: what format calibration (`hypic_rag.calibration.cache_format`) and the cache-format
evaluation (`evals/cache_formats.py`) read. It meets the runtime's `SegmentSource` protocol structurally, as
`SegmentCache` does (the cache imports nothing from the runtime)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hypic_rag.entry.schema import Entry, entry_tensor_bytes
from hypic_rag.entry.compression import CacheFormat, cache_format
from hypic_rag.utils.lru import ByteBudgetLRU


class CompressedSource:
    """A `SegmentSource` handing out another source's entries in `cache_format`'s stored form, each compressed once
    and kept in memory (up to `budget_bytes` of stored tensors): what an engine reads from a cache built in that
    format, without building one. The inner source is not closed by `close` (its owner closes it)."""

    def __init__(self, inner: Any, storage_format: str | CacheFormat, budget_bytes: int = 1 << 30) -> None:
        self.inner = inner
        self.storage_format = cache_format(storage_format)
        self._stored: ByteBudgetLRU[Entry] = ByteBudgetLRU(budget_bytes, entry_tensor_bytes)
        self.float32_bytes: dict[tuple[int, tuple[int, ...]], int] = {}
        """Tensor bytes of each distinct entry handed out, as the inner source gave it (float32)."""
        self.stored_bytes: dict[tuple[int, tuple[int, ...]], int] = {}
        """Tensor bytes of each distinct entry handed out, in this format."""

    def check_model(self, model_fingerprint: str, tokenizer_fingerprint: str) -> None:
        self.inner.check_model(model_fingerprint, tokenizer_fingerprint)

    def get_or_encode_segments(
        self, segments: Sequence[Sequence[int]], seam_tokens: int, encode_many: Callable[[list[list[int]]], list[Entry]]
    ) -> tuple[list[Entry], list[bool]]:
        entries, hits = self.inner.get_or_encode_segments(segments, seam_tokens, encode_many)
        return [self._stored_form(seam_tokens, ids, entry) for ids, entry in zip(segments, entries)], hits

    def _stored_form(self, seam_tokens: int, token_ids: Sequence[int], entry: Mapping[str, torch.Tensor]) -> Entry:
        key = (seam_tokens, tuple(int(token) for token in token_ids))
        stored = self._stored.get(key)
        if stored is None:
            stored = self.storage_format.compress(entry)
            self._stored.put(key, stored)
        self.float32_bytes[key] = entry_tensor_bytes(entry)
        self.stored_bytes[key] = entry_tensor_bytes(stored)
        return dict(stored)

    def missing_segments(self, segments: Sequence[Sequence[int]], seam_tokens: int) -> list[list[int]]:
        return self.inner.missing_segments(segments, seam_tokens)

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "cache_format": self.storage_format.name, "entries_compressed": len(self._stored)}

    def close(self) -> None:
        self._stored.clear()
