"""The service object behind the app: the worker, jobs and metrics, and how handlers wait on the worker.

`call` submits a task and awaits its result under the request's deadline; `open_stream` submits a task whose
events a streaming response relays as they come. Both submit before any response starts, so a full queue is a
plain 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends
from starlette.requests import Request

from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import RequestTimeoutError
from hypic_rag.server.jobs import JobRegistry
from hypic_rag.server.metrics import ServiceMetrics
from hypic_rag.server.worker import CONTROL, END_OF_EVENTS, REQUEST, ModelWorker, Task, TaskContext

logger = logging.getLogger(__name__)

T = TypeVar("T")
DEADLINE_SLACK_S = 2.0
"""How long past a deadline a waiter keeps waiting for the worker to report the timeout itself."""
DISCONNECT_POLL_S = 0.25
"""How often a waiting (non-streaming) request checks whether its client went away."""


class EventStream:
    """Events a streaming task pushes from the worker thread, read on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: Task[Any] | None = None

    def push(self, event: Any) -> None:
        """Called from the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self) -> AsyncIterator[Any]:
        """The task's events until it ends; then its result is in `task.future` (or its error is raised)."""
        task = self.task
        assert task is not None
        context = task.context
        try:
            while True:
                remaining = context.deadline + DEADLINE_SLACK_S - time.perf_counter()
                try:
                    event = await asyncio.wait_for(self._queue.get(), timeout=max(remaining, 0.001))
                except TimeoutError:
                    task.cancel()
                    raise RequestTimeoutError(f"request timed out after {context.timeout_s:g} s") from None
                if event is END_OF_EVENTS:
                    break
                yield event
            task.future.result()  # raises the task's error, if any
        finally:
            if not task.future.done():
                task.cancel()  # the client went away: stop generating


async def _cancel_on_disconnect(request: Request, task: Task[Any]) -> None:
    """Cancel `task` once the client of `request` has disconnected (polled; ends when the task does)."""
    while not task.future.done():
        if await request.is_disconnected():
            logger.info("client went away: cancelling its request")
            task.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


class Service:
    """Owns the model worker, the job registry and the metrics of one app."""

    def __init__(self, config: ServerConfig, backend_factory: Callable[[], Any]) -> None:
        self.config = config
        self.jobs = JobRegistry(keep_finished=config.finished_jobs_kept)
        self.worker = ModelWorker(
            backend_factory, queue_size=config.queue_size, jobs=self.jobs, max_pending_jobs=config.max_pending_jobs,
            on_step=lambda report: self.metrics.observe_step(report),
        )
        self.metrics = ServiceMetrics(
            queue_depth=lambda: self.worker.queue_depth,
            queue_capacity=config.queue_size,
            cache_snapshot=self._cache_snapshot,
            job_counts=self.jobs.counts,
            running=lambda: self.worker.generating,
            waiting=lambda: self.worker.waiting,
        )
        self.started_at = time.time()

    @property
    def started(self) -> bool:
        """Whether `start` was called (the worker thread was started)."""
        return self.worker.started

    def start(self) -> None:
        """Build the backend in the worker thread (loads the model) and wait for it; raises the backend's error."""
        self.worker.start(self.config.startup_timeout_s)
        self.started_at = time.time()

    def stop(self) -> None:
        self.worker.shutdown(self.config.shutdown_grace_s)

    @property
    def backend(self) -> Any:
        """The worker's backend; read only its snapshot attributes from outside the worker thread."""
        return self.worker.backend

    def _cache_snapshot(self) -> dict[str, Any]:
        backend = self.worker.backend
        return dict(backend.cache_snapshot) if backend is not None else {}

    def timeout_for(self, requested: float | None) -> float:
        """The request's deadline: what it asked for, at most the server's."""
        limit = self.config.request_timeout_s
        return min(requested, limit) if requested is not None else limit

    async def call(
        self,
        fn: Callable[[Any, TaskContext], T],
        *,
        timeout_s: float | None = None,
        kind: str = REQUEST,
        request: Request | None = None,
    ) -> tuple[T, TaskContext]:
        """Run `fn(backend, context)` on the worker; returns its result and context (for queue timing).

        With `request`, a client that goes away cancels the task (skipped if queued, stopped at its next check if
        running), as a deadline does.
        """
        timeout_s = timeout_s if timeout_s is not None else self.config.request_timeout_s
        task = self.worker.submit(fn, timeout_s=timeout_s, kind=kind)
        waiter = asyncio.wrap_future(task.future)
        watcher = asyncio.ensure_future(_cancel_on_disconnect(request, task)) if request is not None else None
        try:
            result = await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout_s + DEADLINE_SLACK_S)
        except TimeoutError:
            task.cancel()
            raise RequestTimeoutError(f"request timed out after {timeout_s:g} s") from None
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        return result, task.context

    async def control(self, fn: Callable[[Any, TaskContext], T]) -> T:
        """A short task served before queued requests (stats, deletes)."""
        result, _ = await self.call(fn, kind=CONTROL)
        return result

    def open_stream(self, fn: Callable[[Any, TaskContext], Any], *, timeout_s: float) -> EventStream:
        """Submit a streaming task now (429 before any byte is sent); read it with `EventStream.events()`."""
        stream = EventStream(asyncio.get_running_loop())
        stream.task = self.worker.submit(fn, timeout_s=timeout_s, emit_sink=stream.push)
        return stream


async def current_service(request: Request) -> Service:
    """The app's `Service` (`create_app` keeps it in `app.state.service`). A coroutine, so FastAPI calls it on the
    event loop, never in its thread pool (`/healthz` must answer while that pool is busy)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(current_service)]
"""The FastAPI dependency every route takes its service through: `async def route(service: ServiceDep)`."""
