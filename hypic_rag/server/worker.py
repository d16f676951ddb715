"""The model worker: one thread owns the model, engine and cache, and runs every task on them in turn.

The engine is not thread-safe, so the backend is built inside the worker thread and its model is never touched
elsewhere (the retrieval stage reads the index under `ServiceBackend.index_lock`). The service submits tasks into
a bounded queue; a task's outcome lands in its future and what it emits goes to its request's channel.

Generation is continuously batched: the worker runs the backend's `Scheduler` steps (one batched forward for
every running sequence and newly admitted prompts). Questions over the index reach the scheduler from the
retrieval stage's thread (`retrieval_stage.py`, which calls `wake`); a completion task lays out its prompt here,
hands its generations to the scheduler and returns a `Deferred`, and the worker completes the task when its
generations end. Order of service: control tasks (stats, deletes); queued request tasks (started for up to
`START_BUDGET_S` between two steps while sequences are running); one step of the oldest background job when one is
due (`JOB_SHARE`: while sequences generate, a job step comes after at least one scheduler step and only once the
worker has spent `JOB_SHARE` of its time or less on job steps; when nothing is queued or generating, one job step
after another); one scheduler step. Control tasks and job steps hold the backend's `index_lock` (the retrieval
stage reads the index meanwhile). A step whose prefills wait for admission is held, for at most the server's
`prefill_wait_s`, while the retrieval stage is retrieving a batch (`hold_steps_for`): the batch's prefills then
share that pass instead of taking the next one. The queue is bounded: requests not yet generating
(queued here, in the retrieval stage, or waiting for admission to the batch) beyond `queue_size` get
`QueueFullError` (the service answers 429).

Shutdown: new submissions are refused, queued requests fail with 503, generating requests may finish within the
grace period (then they are cancelled at the next step), background jobs stop between steps (every step leaves
the index and cache consistent), and the backend is closed by the worker thread itself.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from hypic_rag.server.deferred import Deferred
from hypic_rag.server.errors import (
    QueueFullError,
    ServiceError,
    ServiceUnavailableError,
)
from hypic_rag.server.jobs import CANCELLED, FAILED, SUCCEEDED, Job, JobRegistry
from hypic_rag.utils.memory import release_free_memory

from hypic_rag.server.task_context import TaskContext

if TYPE_CHECKING:
    from hypic_rag.server.backend import ServiceBackend

logger = logging.getLogger(__name__)

T = TypeVar("T")

CONTROL, REQUEST = "control", "request"
START_BUDGET_S = 0.05
"""How long the worker may spend starting queued requests (retrieval, prompt layout) before running the next
scheduler step, while sequences are generating."""
JOB_SHARE = 0.2
"""The most of the worker's time that background jobs (document indexing and encoding) take while sequences
generate: after a job step of d seconds the next one waits until d * (1 - JOB_SHARE) / JOB_SHARE seconds have
passed, and for at least one scheduler step. The trade: a job step delays every running sequence by its duration,
so while a job is pending under sustained questions answers take up to 1 / (1 - JOB_SHARE) = 1.25x as long, and the
job advances at about JOB_SHARE of its idle pace instead of waiting for a quiet moment that may never come. A share
of time rather than a fixed interval or step count, because job steps range from well under a millisecond (storing
a document) to hundreds (embedding a batch of chunks, saving the FAISS index): the cost to the sequences stays
bounded whatever the step (docs/service.md, "Order of service")."""
RELEASE_AFTER_IDLE_S = 0.5
"""How long the worker stays idle after some work before handing the allocator's free pages back to the system
(`utils.memory.release_free_memory`; once per idle spell, so a steady stream of requests never pays for it)."""


@dataclass(slots=True, eq=False)
class Task(Generic[T]):
    """A unit of work for the worker: `fn(backend, context)`; its outcome lands in `future`."""

    fn: Callable[[ServiceBackend, TaskContext], T]
    context: TaskContext
    kind: str = REQUEST
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def cancel(self) -> None:
        """Stop the task: skipped if still queued, stopped at its next check if running."""
        self.context.cancel_event.set()

    def fail(self, error: BaseException) -> None:
        try:
            self.future.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by its waiter meanwhile


@dataclass(slots=True)
class _JobRun:
    job: Job
    start: Callable[[ServiceBackend], Iterator[Any]]
    steps: Iterator[Any] | None = None


class ModelWorker:
    """One thread running tasks on a backend built by `factory` (called in that thread).

    queue_size bounds the requests waiting (queued here, or waiting in the scheduler for admission);
    max_pending_jobs bounds background jobs. The backend must have `close()`; a `scheduler` attribute (a
    `hypic_rag.runtime.scheduler.Scheduler`) is driven by this thread, and `on_step` sees each of its step reports.
    """

    def __init__(
        self, factory: Callable[[], ServiceBackend], *, queue_size: int, jobs: JobRegistry, max_pending_jobs: int = 32,
        name: str = "hypic-model-worker", on_step: Callable[[Any], None] | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self._factory = factory
        self.queue_size = queue_size
        self.jobs = jobs
        self.max_pending_jobs = max_pending_jobs
        self._condition = threading.Condition()
        self._control: deque[Task[Any]] = deque()
        self._requests: deque[Task[Any]] = deque()
        self._job_runs: deque[_JobRun] = deque()
        self._running: Task[Any] | None = None
        self._in_flight: dict[Task[Any], None] = {}  # tasks whose generations are in the scheduler
        self._last_step_at = 0.0
        self._last_job_step_at = 0.0  # when the last job step ended
        self._job_due_at = 0.0  # while sequences generate, no job step before then (`JOB_SHARE`)
        self._worked_since_idle = False  # a task, step or job ran since the worker was last idle
        self._on_step = on_step
        self.scheduler: Any | None = None  # the backend's scheduler, once built
        self._stopping = False
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._service_seconds = 0.5  # moving average of a request's time in the worker, for Retry-After
        self.backend: ServiceBackend | None = None
        self._prefills_coming: Callable[[], bool] | None = None
        self._prefill_wait_s = 0.0
        self._holding_since: float | None = None  # when the worker began holding a step for coming prefills

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float) -> None:
        """Start the thread and wait until the backend is built; re-raises the factory's error."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the model worker did not start within {timeout_s:g} s")
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def started(self) -> bool:
        """Whether `start` was called."""
        return self._thread.ident is not None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._startup_error is None and not self._stopping

    @property
    def stopping(self) -> bool:
        return self._stopping

    def shutdown(self, grace_s: float) -> None:
        """Refuse new work, fail queued requests, let the running one finish within `grace_s`, close the backend."""
        with self._condition:
            if self._stopping and not self._thread.is_alive():
                return
            self._stopping = True
            pending = list(self._control) + list(self._requests)
            self._control.clear()
            self._requests.clear()
            self._condition.notify_all()
        for task in pending:
            task.fail(ServiceUnavailableError("the server is shutting down; retry later"))
        if pending:
            logger.info("shutdown: failed %d queued requests", len(pending))
        if not self._thread.is_alive():
            return
        self._thread.join(grace_s)
        if self._thread.is_alive():
            running = [task for task in [self._running, *list(self._in_flight)] if task is not None]
            if running:
                logger.warning("shutdown: cancelling %d running requests after %.1f s of grace", len(running), grace_s)
            for task in running:
                task.cancel()
            self._thread.join(max(10.0, grace_s))
        if self._thread.is_alive():
            logger.error("shutdown: the model worker did not stop; its backend may not be closed")

    # ----------------------------------------------------------------------------------------- submission
    def submit(
        self, fn: Callable[[ServiceBackend, TaskContext], T], context: TaskContext, *, kind: str = REQUEST,
        waiting_elsewhere: int = 0,
    ) -> Task[T]:
        """Queue `fn`; raises `QueueFullError` (with Retry-After) when the request queue is full (counting
        `waiting_elsewhere` requests: the retrieval stage's)."""
        task: Task[T] = Task(fn, context, kind)
        with self._condition:
            if kind == CONTROL:
                self._check_accepting()
                if len(self._control) >= self.queue_size:
                    self._refuse()
            else:
                self.check_room(waiting_elsewhere)
            (self._control if kind == CONTROL else self._requests).append(task)
            self._condition.notify()
        return task

    def check_room(self, waiting_elsewhere: int = 0) -> None:
        """Raise unless one more request may wait: 503 while not ready or stopping, `QueueFullError` when
        `queue_size` requests wait already (queued here, waiting for admission to the batch, or
        `waiting_elsewhere`)."""
        self._check_accepting()
        if len(self._requests) + self._scheduler_waiting() + waiting_elsewhere >= self.queue_size:
            self._refuse()

    def _refuse(self) -> None:
        retry_after = self.retry_after_seconds()
        raise QueueFullError(
            f"the request queue is full ({self.queue_size} waiting); retry in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )

    def hold_steps_for(self, prefills_coming: Callable[[], bool], wait_s: float) -> None:
        """Let a step whose prefills wait for admission be held up to `wait_s` while `prefills_coming()` (another
        thread is about to submit more: the retrieval stage retrieving a batch), so that those prefills run in the
        same batched pass. Submitting wakes the worker (`wake`), which then steps at once; 0 never holds."""
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
        with self._condition:
            self._prefills_coming, self._prefill_wait_s = prefills_coming, wait_s

    def _hold_remaining(self) -> float:
        """(Holding the condition, the scheduler generating) seconds the next step should still be held for
        coming prefills (`hold_steps_for`); 0: step now. A prefill already waits for admission and more are being
        retrieved: their prefills would otherwise take a pass of their own right after this one (a pass of four
        prefills of the bundled model costs about what two passes of one do). Running decodes wait as long. No hold
        when every slot is taken (the waiting prefills could not be admitted by this step anyway)."""
        coming, scheduler = self._prefills_coming, self.scheduler
        if (coming is None or self._prefill_wait_s <= 0 or scheduler.waiting == 0
                or scheduler.running >= scheduler.config.max_running or not coming()):
            self._holding_since = None
            return 0.0
        now = time.perf_counter()
        if self._holding_since is None:
            self._holding_since = now
        remaining = self._holding_since + self._prefill_wait_s - now
        if remaining <= 0:
            self._holding_since = None
            return 0.0
        return remaining

    def wake(self) -> None:
        """Work arrived from another thread (the retrieval stage submitted to the scheduler)."""
        with self._condition:
            self._condition.notify()

    def submit_job(self, job: Job, start: Callable[[Any], Iterator[Any]]) -> None:
        """Queue a background job: `start(backend)` gives an iterator whose each `next` is one step of work."""
        with self._condition:
            self._check_accepting()
            if len(self._job_runs) >= self.max_pending_jobs:
                raise QueueFullError(
                    f"{len(self._job_runs)} document jobs are already pending; retry when one has finished",
                    headers={"Retry-After": str(max(1, math.ceil(self._service_seconds * 4)))},
                )
            self._job_runs.append(_JobRun(job, start))
            self._condition.notify()

    def _check_accepting(self) -> None:
        if self._stopping:
            raise ServiceUnavailableError("the server is shutting down")
        if not self.ready:
            raise ServiceUnavailableError("the model worker is not ready")

    # ----------------------------------------------------------------------------------------- introspection
    def _scheduler_waiting(self) -> int:
        scheduler = self.scheduler
        return scheduler.waiting if scheduler is not None else 0

    @property
    def queue_depth(self) -> int:
        """Requests held: queued, being started, or generating."""
        running = self._running
        starting = 1 if running is not None and running.kind == REQUEST and running not in self._in_flight else 0
        return len(self._requests) + len(self._control) + len(self._in_flight) + starting

    @property
    def generating(self) -> int:
        """Sequences admitted to the batch (encoding, prefilling or decoding)."""
        scheduler = self.scheduler
        return scheduler.running if scheduler is not None else 0

    @property
    def waiting(self) -> int:
        """Requests queued here plus sequences waiting for admission to the batch."""
        return len(self._requests) + self._scheduler_waiting()

    @property
    def pending_jobs(self) -> int:
        return len(self._job_runs)

    def retry_after_seconds(self) -> int:
        """An estimate of when a slot frees up: the mean service time for every batch of `max_running` requests
        waiting ahead, at least 1 s."""
        scheduler = self.scheduler
        slots = scheduler.config.max_running if scheduler is not None else 1
        return max(1, math.ceil(self._service_seconds * max(1.0, self.waiting / slots)))

    # ----------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            self.backend = self._factory()
        except BaseException as error:  # raised again by start(), whose caller reports it
            logger.debug("the model worker could not build its backend", exc_info=True)
            self._startup_error = error
            self._ready.set()
            return
        self.scheduler = getattr(self.backend, "scheduler", None)
        if self.scheduler is not None and self._on_step is not None:
            self.scheduler.on_step = self._on_step
        self._ready.set()
        try:
            while True:
                kind, item = self._next()
                if kind == "stop":
                    break
                try:
                    if kind == "task":
                        self._execute(item)
                    elif kind == "step":
                        try:
                            self.scheduler.step()
                        finally:
                            self._last_step_at = time.perf_counter()  # queued requests get their start budget now
                    elif kind == "idle":
                        release_free_memory()
                    else:
                        began = time.perf_counter()
                        try:
                            self._step(item)
                        finally:
                            self._last_job_step_at = ended = time.perf_counter()
                            self._job_due_at = ended + (ended - began) * (1 - JOB_SHARE) / JOB_SHARE
                    if kind != "idle":
                        self._worked_since_idle = True
                except Exception as error:  # a bug: the worker goes on serving the others
                    logger.exception("the model worker's %s failed", kind)
                    if kind == "task":
                        self._settle(item, None, error)
        finally:
            if self.scheduler is not None:
                self.scheduler.fail_all(ServiceUnavailableError("the server shut down before the request finished"))
            self._stop_jobs()
            try:
                self.backend.close()
            except Exception:
                logger.exception("closing the backend failed")

    def _next(self) -> tuple[str, Any]:
        """The next piece of work: ("task", Task), ("step", None), ("job", _JobRun), ("stop", None), or ("idle",
        None) once when nothing was left to do for `RELEASE_AFTER_IDLE_S` after some work (the worker then calls
        `utils.memory.release_free_memory`: a burst's freed tensors otherwise stay resident in the allocator's
        arenas)."""
        idle_since: float | None = None
        with self._condition:
            while True:
                generating = self.scheduler is not None and self.scheduler.has_work
                if self._control:
                    return "task", self._control.popleft()
                starting = not generating or time.perf_counter() - self._last_step_at < START_BUDGET_S
                if self._requests and starting:
                    return "task", self._requests.popleft()
                if generating and self._job_runs and not self._stopping and self._job_due():
                    return "job", self._job_runs[0]
                if generating:
                    held = self._hold_remaining()
                    if held > 0:
                        self._condition.wait(held)
                        continue
                    return "step", None
                if self._stopping:
                    return "stop", None
                if self._job_runs:
                    return "job", self._job_runs[0]
                if self._worked_since_idle:  # idle after work: hand back what the work freed, once it stays idle
                    now = time.perf_counter()
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= RELEASE_AFTER_IDLE_S:
                        self._worked_since_idle = False
                        return "idle", None
                    self._condition.wait(RELEASE_AFTER_IDLE_S - (now - idle_since))
                    continue
                self._condition.wait()

    def _job_due(self) -> bool:
        """(Sequences generating) whether a job step may run before the next scheduler step: a scheduler step
        ran since the last job step, and the last job step's share of time is spent (`JOB_SHARE`)."""
        return self._last_step_at >= self._last_job_step_at and time.perf_counter() >= self._job_due_at

    def _execute(self, task: Task[Any]) -> None:
        context = task.context
        try:
            context.check()
        except ServiceError as error:
            task.fail(error)
            return
        if not task.future.set_running_or_notify_cancel():
            return  # its waiter gave up while it was queued
        context.started_at = time.perf_counter()
        self._running = task
        backend = self.backend
        assert backend is not None
        try:
            if task.kind == CONTROL:  # stats, deletes: the index is the retrieval stage's meanwhile too
                with backend.index_lock:
                    result = task.fn(backend, context)
            else:
                result = task.fn(backend, context)
        except BaseException as error:
            self._settle(task, None, error)
        else:
            if isinstance(result, Deferred):  # its generations are in the scheduler: settled by a later step
                self._in_flight[task] = None
                result.on_settle(lambda value, error: self._settle(task, value, error))
            else:
                self._settle(task, result, None)
        finally:
            self._running = None

    def _settle(self, task: Task[Any], result: Any, error: BaseException | None) -> None:
        """Complete `task` with its result or error (in the worker thread)."""
        self._in_flight.pop(task, None)
        if error is not None:
            if not isinstance(error, ServiceError):  # its request's handler logs it once, with the request id
                logger.debug("task failed", exc_info=error)
            task.fail(error)
        else:
            try:
                task.future.set_result(result)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled by its waiter meanwhile
        if task.kind == REQUEST and task.context.started_at is not None:
            elapsed = time.perf_counter() - task.context.started_at
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * elapsed

    def _step(self, run: _JobRun) -> None:
        job = run.job
        backend = self.backend
        assert backend is not None
        try:
            with backend.index_lock:  # a job step writes the index the retrieval stage reads
                if run.steps is None:
                    self.jobs.start(job)
                    run.steps = run.start(backend)
                next(run.steps)
            return
        except StopIteration as done:
            self.jobs.finish(job, SUCCEEDED, result=done.value if isinstance(done.value, dict) else None)
        except Exception as error:
            if isinstance(error, ServiceError):  # refused on purpose: one line
                logger.warning("job %s failed: %s", job.job_id, " ".join(str(error).split()))
            else:
                logger.error("job %s failed: %s", job.job_id, type(error).__name__, exc_info=error)
            message = str(error) if isinstance(error, ServiceError) else f"{type(error).__name__}: {error}"
            self.jobs.finish(job, FAILED, error=message)
        with self._condition:
            if self._job_runs and self._job_runs[0] is run:
                self._job_runs.popleft()

    def _stop_jobs(self) -> None:
        with self._condition:
            runs = list(self._job_runs)
            self._job_runs.clear()
        for run in runs:
            close = getattr(run.steps, "close", None)
            if close is not None:
                close()  # runs the job's clean-up in this thread
            self.jobs.finish(
                run.job,
                CANCELLED,
                error="the server shut down before the job finished; documents indexed so far are kept, "
                "resubmit the rest",
            )
