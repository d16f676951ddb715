"""Where the engine gets segment entries: the `SegmentSource` protocol and its in-process implementation.

The runtime imports nothing from `hypic_rag.cache`. A persistent source is `hypic_rag.cache.segment_cache.SegmentCache`
opened with a namespace (it meets this protocol structurally); without one the engine keeps entries in a
`MemorySegmentSource` for the life of the process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from hypic_rag.entry.schema import Entry, entry_tensor_bytes
from hypic_rag.utils.lru import ByteBudgetLRU

EncodeMany = Callable[[list[list[int]]], Sequence[Mapping[str, torch.Tensor]]]
"""Encodes segments (token id lists) into their entries, one per segment, in order."""


@runtime_checkable
class SegmentSource(Protocol):
    """Segment entries for a seam window: fetched when held, else encoded (and kept for later requests).

    A source holds one model's entries: `check_model` refuses another model, so that no model is ever served
    another's state (the engine calls it when it is given the source).
    """

    def check_model(self, model_fingerprint: str, tokenizer_fingerprint: str) -> None:
        """Return if the source holds (or may hold) entries of this model; ValueError otherwise."""
        ...

    def get_or_encode_segments(
        self, segments: Sequence[Sequence[int]], seam_tokens: int, encode_many: EncodeMany
    ) -> tuple[list[Entry], list[bool]]:
        """(entries, hits) in request order for `segments` [L_i] with entries for seam window `seam_tokens`; the
        segments not held are encoded by one `encode_many` call (if it raises, none of them is kept)."""
        ...

    def missing_segments(self, segments: Sequence[Sequence[int]], seam_tokens: int) -> list[list[int]]:
        """The segments without an entry for `seam_tokens` (a lookup that reads and counts nothing)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counts and sizes of what the source holds (its own keys; `entries` at least)."""
        ...

    def close(self) -> None:
        """Release what the source holds (idempotent)."""
        ...


class MemorySegmentSource:
    """Entries kept in this process only, least recently used evicted past `budget_bytes` of tensors.

    Keyed by (seam window, token ids): the first model it is checked against (`check_model`) is the only one it
    serves, so no model identity is needed in the key.
    """

    def __init__(self, budget_bytes: int = 1 << 30) -> None:
        self._entries: ByteBudgetLRU[Entry] = ByteBudgetLRU(budget_bytes, entry_tensor_bytes)
        self._model: tuple[str, str] | None = None
        self.hits = 0
        self.misses = 0

    def check_model(self, model_fingerprint: str, tokenizer_fingerprint: str) -> None:
        model = (model_fingerprint, tokenizer_fingerprint)
        if self._model is None:
            self._model = model
        elif self._model != model:
            raise ValueError("this in-memory segment source holds another model's entries; give each model its own")

    def get_or_encode_segments(
        self, segments: Sequence[Sequence[int]], seam_tokens: int, encode_many: EncodeMany
    ) -> tuple[list[Entry], list[bool]]:
        keys = [(seam_tokens, tuple(segment)) for segment in segments]
        found = [self._entries.get(key) for key in keys]
        missing = [list(segment) for segment, entry in zip(segments, found) if entry is None]
        encoded = iter(encode_many(missing)) if missing else iter(())
        entries: list[Entry] = []
        hits: list[bool] = []
        for key, entry in zip(keys, found):
            hits.append(entry is not None)
            if entry is None:
                entry = dict(next(encoded))
                self._entries.put(key, entry)
            entries.append(entry)
        self.hits += sum(hits)
        self.misses += len(hits) - sum(hits)
        return entries, hits

    def missing_segments(self, segments: Sequence[Sequence[int]], seam_tokens: int) -> list[list[int]]:
        return [list(segment) for segment in segments if (seam_tokens, tuple(segment)) not in self._entries]

    def stats(self) -> dict[str, Any]:
        return {
            "entries": len(self._entries),
            "bytes": self._entries.bytes,
            "budget_bytes": self._entries.budget_bytes,
            "evictions": self._entries.evictions,
            "hits": self.hits,
            "misses": self.misses,
        }

    def close(self) -> None:
        self._entries.clear()
