"""Streams are generators that yield items and return a final result (`return value` -> StopIteration.value)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def drain(stream: Generator[Item, None, Result], on_item: Callable[[Item], None] | None = None) -> Result:
    """Run `stream` to its end, handing each item to `on_item`; returns the stream's return value."""
    while True:
        try:
            item = next(stream)
        except StopIteration as done:
            return done.value
        if on_item is not None:
            on_item(item)


class StrippedDeltas:
    """Re-cut a stream of text deltas so that they add up to the stripped text, as the deltas arrive.

    Leading whitespace is dropped; trailing whitespace is held until more text follows (and dropped if none
    does). `"".join(map(stripped.feed, deltas)) == "".join(deltas).strip()` for any deltas: a stream whose
    final text is `text.strip()` (a RAG answer) thus streams exactly its final text.
    """

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, delta: str) -> str:
        """The part of `delta` (with whitespace held from before) that belongs to the stripped text now."""
        if not self._started:
            delta = delta.lstrip()
            if not delta:
                return ""
            self._started = True
        text = self._held + delta
        settled = text.rstrip()
        self._held = text[len(settled) :]
        return settled
