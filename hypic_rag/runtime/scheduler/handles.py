"""Sinks that hand a sequence's output from the scheduler's thread to its consumer: blocking, asyncio, callbacks.

`QueueSink` feeds a `GenerationStream` (the same stream type `Engine.stream` returns) that any thread iterates;
`AsyncQueueSink` feeds an async iterator on an event loop; `CallbackSink` calls functions in the scheduler's
thread (the service's model worker, which drives the steps itself, relays them to its handlers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.scheduler.sequence import Sequence

_END = object()


class CallbackSink:
    """Calls `on_token(token_id, delta)`, then `on_finish(generation)` or `on_fail(error)`, in the scheduler's
    thread."""

    def __init__(
        self, on_token: Callable[[int, str], None] | None = None, on_finish: Callable[[Generation], None] | None = None,
        on_fail: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._on_token, self._on_finish, self._on_fail = on_token, on_finish, on_fail

    def token(self, token_id: int, delta: str) -> None:
        if self._on_token is not None:
            self._on_token(token_id, delta)

    def finish(self, generation: Generation) -> None:
        if self._on_finish is not None:
            self._on_finish(generation)

    def fail(self, error: BaseException) -> None:
        if self._on_fail is not None:
            self._on_fail(error)


class QueueSink:
    """Tokens in a thread-safe queue and the outcome in a `concurrent.futures.Future` (`future`)."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.future: concurrent.futures.Future[Generation] = concurrent.futures.Future()

    def token(self, token_id: int, delta: str) -> None:
        self.items.put((token_id, delta))

    def finish(self, generation: Generation) -> None:
        self.future.set_result(generation)
        self.items.put(_END)

    def fail(self, error: BaseException) -> None:
        self.future.set_exception(error)
        self.items.put(_END)

    def steps(
        self, sequence: Sequence, drive: Callable[[], bool] | None = None
    ) -> Generator[tuple[int, str], None, Generation]:
        """(token_id, text_delta) as the scheduler produces them, returning the `Generation`; closing the generator
        early cancels the sequence. While none is ready, `drive()` runs a scheduler step in this thread when nobody
        else does (it returns False when someone does: then this waits)."""
        try:
            while True:
                while drive is not None and self.items.empty() and drive():
                    pass
                item = self.items.get()
                if item is _END:
                    break
                yield item
            return self.future.result()
        finally:
            if not self.future.done():
                sequence.cancel()


class AsyncQueueSink:
    """Tokens and the outcome delivered on an asyncio event loop (`events`, `result`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self.future: asyncio.Future[Generation] = loop.create_future()

    def _call(self, function: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(function, *args)

    def token(self, token_id: int, delta: str) -> None:
        self._call(self._items.put_nowait, (token_id, delta))

    def finish(self, generation: Generation) -> None:
        self._call(self._settle, generation, None)

    def fail(self, error: BaseException) -> None:
        self._call(self._settle, None, error)

    def _settle(self, generation: Generation | None, error: BaseException | None) -> None:
        if not self.future.done():
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(generation)  # type: ignore[arg-type]
        self._items.put_nowait(_END)

    async def events(self, sequence: Sequence) -> AsyncIterator[tuple[int, str]]:
        """(token_id, text_delta) as they come; the sequence is cancelled if the iteration stops early. The
        `Generation` is `await sink.future` afterwards."""
        try:
            while True:
                item = await self._items.get()
                if item is _END:
                    return
                yield item
        finally:
            if not self.future.done():
                sequence.cancel()
