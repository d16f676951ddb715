"""Blocking model work off the event loop: one call in a worker thread, or one stream iterated in its own thread.

The engine is synchronous (and its runtime lock is a thread lock), so the async paths of the integration hand
the work to threads and await it; the event loop keeps running other tasks meanwhile. A stream is iterated from
start to end in one dedicated thread (the runtime lock it holds is then acquired and released by the same
thread) and its items are relayed to the loop through a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, TypeVar

__all__ = ["in_thread", "relay_stream"]

Result = TypeVar("Result")
Item = TypeVar("Item")


async def in_thread(function: Callable[..., Result], *args: Any, **kwargs: Any) -> Result:
    """`function(*args, **kwargs)` run in a worker thread (with this context's variables), awaited."""
    return await asyncio.to_thread(function, *args, **kwargs)


async def relay_stream(open_items: Callable[[], Iterator[Item]]) -> AsyncGenerator[Item, None]:
    """The items of `open_items()`, which is called and iterated in one new thread, as they come.

    Errors raised there are raised here. Stopping early (`aclose()`, a cancelled consumer) stops the thread's
    iteration at its next item and closes the iterator in that thread (its clean-up, such as releasing the
    runtime lock, runs there).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    stopped = threading.Event()

    def post(kind: str, value: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is listening any more
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def produce() -> None:
        try:
            items = open_items()
            try:
                for item in items:
                    post("item", item)
                    if stopped.is_set():
                        break
            finally:
                close = getattr(items, "close", None)
                if close is not None:
                    close()
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
            post("error", error)
            return
        post("end", None)

    context = contextvars.copy_context()
    threading.Thread(target=context.run, args=(produce,), name="hypic-rag-stream", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stopped.set()
