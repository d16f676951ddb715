"""The service object behind the app: the model worker, the retrieval stage, jobs and metrics.

A route hands its work over and gets an `EventChannel` back at once (so a full queue is a plain 429 before any
response starts): `ask` queues a question for the retrieval stage (whose batches go to the scheduler the worker
steps), `submit` a task for the model worker. The route then awaits `channel.result()` or relays
`channel.events()` as server-sent events (`sse.relay`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import Request

from hypic_rag.pipeline.answering import Answer, Question
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import ServiceBackend
from hypic_rag.server.channel import EventChannel
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import RequestCancelledError, ServiceUnavailableError
from hypic_rag.server.jobs import JobRegistry
from hypic_rag.server.metrics import ServiceMetrics
from hypic_rag.server.retrieval_stage import PendingQuestion, RetrievalStage
from hypic_rag.server.task_context import TaskContext
from hypic_rag.server.worker import CONTROL, REQUEST, ModelWorker

logger = logging.getLogger(__name__)

WorkerTask = Callable[[ServiceBackend, TaskContext], Any]
"""What a route runs on the model worker: `fn(backend, context)` returns its result, or a `Deferred` of it that
the scheduler's steps settle."""


class Service:
    """Owns the model worker, the job registry and the metrics of one app."""

    def __init__(self, config: ServerConfig, backend_factory: Callable[[], ServiceBackend]) -> None:
        self.config = config
        self.jobs = JobRegistry(keep_finished=config.finished_jobs_kept)
        self.worker = ModelWorker(
            backend_factory, queue_size=config.queue_size, jobs=self.jobs, max_pending_jobs=config.max_pending_jobs,
            on_step=lambda report: self.metrics.observe_step(report),
        )
        self.retrieval: RetrievalStage | None = None
        """Built once the backend is (`start`)."""
        self.metrics = ServiceMetrics(
            queue_depth=lambda: self.queue_depth,
            queue_capacity=config.queue_size,
            cache_snapshot=self._cache_snapshot,
            job_counts=self.jobs.counts,
            running=lambda: self.worker.generating,
            waiting=lambda: self.waiting,
        )
        self.started_at = time.time()

    @property
    def started(self) -> bool:
        """Whether `start` was called (the worker thread was started)."""
        return self.worker.started

    def start(self) -> None:
        """Build the backend in the worker thread (loads the model) and wait for it, then start the retrieval
        stage; raises the backend's error."""
        self.worker.start(self.config.startup_timeout_s)
        assert self.worker.backend is not None
        self.retrieval = RetrievalStage(self.worker.backend, self.worker, queue_size=self.config.queue_size,
                                        max_batch=self.config.retrieval_batch).start()
        retrieval = self.retrieval
        self.worker.hold_steps_for(lambda: retrieval.retrieving_batch, self.config.prefill_wait_s)
        self.started_at = time.time()

    def stop(self) -> None:
        if self.retrieval is not None:
            self.retrieval.stop()
        self.worker.shutdown(self.config.shutdown_grace_s)

    @property
    def backend(self) -> ServiceBackend:
        """The worker's backend; read only its snapshot attributes from outside the worker thread."""
        backend = self.worker.backend
        if backend is None:
            raise ServiceUnavailableError("the model worker is not ready")
        return backend

    @property
    def waiting(self) -> int:
        """Requests not yet generating: queued for the worker or the retrieval stage, waiting for admission."""
        stage = self.retrieval.waiting if self.retrieval is not None else 0
        return self.worker.waiting + stage

    @property
    def queue_depth(self) -> int:
        """Requests held: waiting, being started, or generating."""
        stage = self.retrieval.waiting + self.retrieval.generating if self.retrieval is not None else 0
        return self.worker.queue_depth + stage

    def _cache_snapshot(self) -> dict[str, Any]:
        backend = self.worker.backend
        return dict(backend.cache_snapshot) if backend is not None else {}

    def timeout_for(self, requested: float | None) -> float:
        """The request's deadline: what it asked for, at most the server's."""
        limit = self.config.request_timeout_s
        return min(requested, limit) if requested is not None else limit

    def _channel(self, timeout_s: float | None) -> EventChannel[Any]:
        timeout_s = timeout_s if timeout_s is not None else self.config.request_timeout_s
        now = time.perf_counter()
        return EventChannel(asyncio.get_running_loop(), TaskContext(now, now + timeout_s, timeout_s))

    def ask(self, question: Question, params: SamplingParams, *, timeout_s: float) -> EventChannel[Answer]:
        """Queue `question` for the retrieval stage (429 when the queue is full); its sources, text and `Answer`
        arrive in the channel."""
        channel: EventChannel[Answer] = self._channel(timeout_s)
        if self.retrieval is None:
            raise ServiceUnavailableError("the model worker is not ready")
        self.retrieval.submit(PendingQuestion(question, params, channel))
        return channel

    def submit(self, fn: WorkerTask, *, timeout_s: float | None = None, kind: str = REQUEST) -> EventChannel[Any]:
        """Queue `fn(backend, context)` on the model worker (429 when the queue is full); what it pushes
        (`context.emit`) and its outcome arrive in the channel."""
        channel: EventChannel[Any] = self._channel(timeout_s)
        channel.context.emit_sink = channel.push
        stage = self.retrieval.waiting if self.retrieval is not None else 0
        task = self.worker.submit(fn, channel.context, kind=kind, waiting_elsewhere=stage)
        task.future.add_done_callback(lambda future: _settle_from(channel, future))
        return channel

    async def call(self, fn: WorkerTask, *, timeout_s: float | None = None, kind: str = REQUEST,
                   request: Request | None = None) -> tuple[Any, TaskContext]:
        """`submit` and wait for the result: (result, context); with `request`, a client that goes away cancels
        the task (skipped if queued, stopped at its next check if running), as a deadline does."""
        channel = self.submit(fn, timeout_s=timeout_s, kind=kind)
        return await channel.result(request), channel.context

    async def control(self, fn: WorkerTask) -> Any:
        """A short task served before queued requests (stats, deletes)."""
        result, _ = await self.call(fn, kind=CONTROL)
        return result


def _settle_from(channel: EventChannel[Any], future: concurrent.futures.Future[Any]) -> None:
    """Settle `channel` with a worker task's outcome (called in the thread that completed it)."""
    if future.cancelled():
        channel.reject(RequestCancelledError("request cancelled"))
    elif future.exception() is not None:
        channel.reject(future.exception())  # type: ignore[arg-type]
    else:
        channel.resolve(future.result())


async def current_service(request: Request) -> Service:
    """The app's `Service` (`create_app` keeps it in `app.state.service`). A coroutine, so FastAPI calls it on the
    event loop, never in its thread pool (`/healthz` must answer while that pool is busy)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(current_service)]
"""The FastAPI dependency every route takes its service through: `async def route(service: ServiceDep)`."""
