"""`EventChannel`: what a request's handler reads while other threads work on it, and the events it carries.

Whoever produces the request's output (the retrieval stage, the scheduler's sinks in the model worker thread, a
worker task) pushes `SourcesEvent` / `TextEvent`s and settles the channel once with the result or an error; the
handler, on the event loop, either iterates `events()` (a streaming response, through `sse.relay`) or awaits
`result()`. Both are bounded by the request's deadline; a handler that stops reading early cancels the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

from starlette.requests import Request

from hypic_rag.server.errors import RequestTimeoutError
from hypic_rag.server.events import Event
from hypic_rag.server.task_context import TaskContext

logger = logging.getLogger(__name__)

R = TypeVar("R")
DEADLINE_SLACK_S = 2.0
"""How long past a deadline a reader keeps waiting for the producer to report the timeout itself."""
DISCONNECT_POLL_S = 0.25
"""How often a waiting (non-streaming) request checks whether its client went away."""


_SETTLED = object()


class EventChannel(Generic[R]):
    """A request's events and outcome, pushed from any thread, read on `loop` (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, context: TaskContext) -> None:
        self.context = context
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._outcome: asyncio.Future[R] = loop.create_future()

    # ------------------------------------------------------------------------------ producers (any thread)
    def push(self, event: Event) -> None:
        self._call(self._queue.put_nowait, event)

    def resolve(self, result: R) -> None:
        self._call(self._settle, result, None)

    def reject(self, error: BaseException) -> None:
        self._call(self._settle, None, error)

    def _call(self, function: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(function, *args)

    def _settle(self, result: R | None, error: BaseException | None) -> None:
        if self._outcome.done():
            return
        if error is not None:
            self._outcome.set_exception(error)
            self._outcome.exception()  # read: a reader that went away leaves no "never retrieved" warning
        else:
            self._outcome.set_result(result)  # type: ignore[arg-type]
        self._queue.put_nowait(_SETTLED)

    # ------------------------------------------------------------------------------ the handler (event loop)
    @property
    def settled(self) -> bool:
        return self._outcome.done()

    def cancel(self) -> None:
        """Stop the request: skipped if not started, dropped at its next check if running."""
        self.context.cancel_event.set()

    def _remaining(self) -> float:
        return max(self.context.deadline + DEADLINE_SLACK_S - time.perf_counter(), 0.001)

    def _timed_out(self) -> RequestTimeoutError:
        self.cancel()
        return RequestTimeoutError(f"request timed out after {self.context.timeout_s:g} s")

    async def events(self) -> AsyncIterator[Event]:
        """The events until the request settles; then `outcome()` is its result (or raises its error). Stopping
        early (the client went away) cancels the request."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self._queue.get(), timeout=self._remaining())
                except TimeoutError:
                    raise self._timed_out() from None
                if event is _SETTLED:
                    return
                yield event
        finally:
            if not self._outcome.done():
                self.cancel()

    def outcome(self) -> R:
        """The result once settled (raises the request's error)."""
        return self._outcome.result()

    async def result(self, request: Request | None = None) -> R:
        """Wait for the result under the deadline; with `request`, a client that goes away cancels the request."""
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(request)) if request is not None else None
        try:
            return await asyncio.wait_for(asyncio.shield(self._outcome), timeout=self._remaining())
        except TimeoutError:
            raise self._timed_out() from None
        except asyncio.CancelledError:
            self.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while not self._outcome.done():
            if await request.is_disconnected():
                logger.info("client went away: cancelling its request")
                self.cancel()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)
