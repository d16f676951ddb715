"""Streams: iterators over the items of a generator that also returns a final result.

A `ResultStream` wraps such a generator (its `return value` ends the iteration): iterate it for the items, then
read `.result`; `.close()` stops it early, and an optional `check` runs before every step (a deadline or a
cancellation raises there). `Engine.stream` returns one (`GenerationStream`), and so does `RagPipeline.stream`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class ResultStream(Generic[Item, Result]):
    """Iterates `steps`' items; `.result` is its return value once the iteration has ended.

    check: called before every step (each `next`, the one that ends the stream included); whatever it raises
    stops the stream there: the generator is closed (its clean-up runs) and the exception propagates.
    """

    def __init__(self, steps: Generator[Item, None, Result], check: Callable[[], None] | None = None) -> None:
        self._steps = steps
        self._check = check
        self._finished = False
        self._closed = False
        self._result: Result | None = None

    def __iter__(self) -> Iterator[Item]:
        return self

    def __next__(self) -> Item:
        if self._finished or self._closed:
            raise StopIteration
        if self._check is not None:
            try:
                self._check()
            except BaseException:
                self.close()
                raise
        try:
            return next(self._steps)
        except StopIteration as done:
            self._finished = True
            self._result = done.value
            raise StopIteration from None

    @property
    def finished(self) -> bool:
        """True once the generator has returned (`.result` is then available)."""
        return self._finished

    @property
    def result(self) -> Result:
        """The generator's return value; RuntimeError while the stream has not ended (or was closed before)."""
        if not self._finished:
            state = "was closed before its end" if self._closed else "has not ended yet"
            raise RuntimeError(f"the stream {state}: iterate it to the end (or call run()) first")
        return self._result  # type: ignore[return-value]

    def run(self, on_item: Callable[[Item], None] | None = None) -> Result:
        """Iterate to the end, handing each item to `on_item`; returns `.result`."""
        for item in self:
            if on_item is not None:
                on_item(item)
        return self.result

    def close(self) -> None:
        """Stop early: the generator is closed (its `finally` blocks run) and the stream yields nothing more; a
        no-op once ended."""
        if not self._finished:
            self._closed = True
        self._steps.close()

    def __enter__(self) -> ResultStream[Item, Result]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def drain(
    stream: Generator[Item, None, Result] | ResultStream[Item, Result], on_item: Callable[[Item], None] | None = None,
) -> Result:
    """Run `stream` (a `ResultStream` or a bare generator) to its end, handing each item to `on_item`; returns its
    result."""
    if not isinstance(stream, ResultStream):
        stream = ResultStream(stream)
    return stream.run(on_item)


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
