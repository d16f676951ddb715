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
