"""Where the engine keeps segment entries: the `SegmentSource` storage protocol and its in-process implementation.

A source only stores (contains / get / put / remove, keyed by seam window and token ids); it never computes an
entry. What it lacks is encoded by the one get-or-encode home, `get_or_encode.SegmentEntries`, and put back.
The runtime imports nothing from `hypic_rag.cache`: a persistent source is `hypic_rag.cache.segment_cache.SegmentCache`
opened with a namespace (it meets this protocol structurally); without one the engine keeps entries in a
`MemorySegmentSource` for the life of the process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from hypic_rag.entry.schema import Entry, entry_tensor_bytes
from hypic_rag.utils.lru import ByteBudgetLRU


@runtime_checkable
class SegmentSource(Protocol):
    """Storage of one model's segment entries, keyed by (seam window `seam_tokens`, token ids of the segment).

    A source holds one model's entries: `check_model` refuses another model, so that no model is ever served
    another's state (the engine calls it when it is given the source). Entries are handed out in the source's
    stored form (a compressed cache format, `hypic_rag.entry`), the same for a put and a later get.
    """

    def check_model(self, model_fingerprint: str, tokenizer_fingerprint: str) -> None:
        """Return if the source holds (or may hold) entries of this model; ValueError otherwise."""
        ...

    def contains_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> list[bool]:
        """Whether an entry of each segment is held for `seam_tokens` (a lookup that reads and counts nothing)."""
        ...

    def get_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> list[Entry | None]:
        """The held entries of `segments` [L_i] for `seam_tokens` in request order, None for each one not held (a
        damaged one is dropped, counted and None); counts the hits and misses."""
        ...

    def put_many(
        self, seam_tokens: int, segments: Sequence[Sequence[int]], entries: Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Entry]:
        """Store the entries of `segments` for `seam_tokens` (one write); returns each as a later `get_many` would
        (its stored form). ValueError when the counts differ or an entry's token ids are not its segment's."""
        ...

    def remove_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> int:
        """Drop the entries of `segments` for `seam_tokens`; the number that were held."""
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

    def contains_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> list[bool]:
        return [(seam_tokens, tuple(segment)) in self._entries for segment in segments]

    def get_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> list[Entry | None]:
        found = [self._entries.get((seam_tokens, tuple(segment))) for segment in segments]
        held = sum(entry is not None for entry in found)
        self.hits += held
        self.misses += len(found) - held
        return found

    def put_many(
        self, seam_tokens: int, segments: Sequence[Sequence[int]], entries: Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Entry]:
        if len(entries) != len(segments):
            raise ValueError(f"{len(entries)} entries given for {len(segments)} segments")
        kept = [dict(entry) for entry in entries]
        for segment, entry in zip(segments, kept):
            self._entries.put((seam_tokens, tuple(segment)), entry)
        return kept

    def remove_many(self, seam_tokens: int, segments: Sequence[Sequence[int]]) -> int:
        return sum(self._entries.remove((seam_tokens, tuple(segment))) for segment in segments)

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
