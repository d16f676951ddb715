"""The retrieval stage: questions are retrieved for in batches, outside the model worker, then generated.

`/v1/ask` (and chat over the index) hands its question to `RetrievalStage.submit`. The stage's thread takes every
question waiting at once, retrieves for all of them in one batch (`RagPipeline.prepare_many`: one embedding call,
FAISS searched together, each question getting the chunks it gets alone), sends each its sources and submits its
generation to the backend's scheduler, whose steps the model worker runs (batched with everything else running).
An `AnswerSink` relays the generation to the request's `EventChannel`: text deltas stripped as the answer is, then
the `Answer`. So a question crosses: route -> stage (retrieval) -> scheduler -> channel -> route.

Batches are gathered as the scheduler gathers admissions (`SchedulerConfig.admit_wait_s`): the clients whose
answers ended since the last batch usually send their next questions within milliseconds, so before retrieving,
the stage waits up to `gather_s` for as many questions as answers ended meanwhile (a lone client's next question
is taken at once). One batch then costs one embedding call and one batched prefill instead of several. A batch
holds at most `max_batch` questions (`ServerConfig.retrieval_batch`): on CPU embedding more at once saves little,
and a smaller batch reaches the worker sooner, its prefill overlapping the next batch's retrieval.

The index is shared with the model worker's document jobs and control tasks: both hold `ServiceBackend.index_lock`
while they use it (the stage for one batch's retrieval).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from hypic_rag.pipeline.answering import Answer, PreparedQuestion, Question
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server.backend import ServiceBackend
from hypic_rag.server.channel import EventChannel
from hypic_rag.server.events import SourcesEvent, TextEvent
from hypic_rag.server.errors import BadRequestError, ServiceError, ServiceUnavailableError
from hypic_rag.runtime.scheduler.config import DEFAULT_ADMIT_WAIT_S
from hypic_rag.server.worker import ModelWorker
from hypic_rag.utils.streaming import StrippedDeltas

logger = logging.getLogger(__name__)

@dataclass(slots=True, eq=False)
class PendingQuestion:
    """A question waiting for retrieval: what to ask, how to sample, and where its events and answer go."""

    question: Question
    params: SamplingParams
    channel: EventChannel[Answer]


class AnswerSink:
    """The scheduler's sink of one answer (called in the model worker thread): stripped text deltas as
    `TextEvent`s, then the `Answer` or the error, into the request's channel."""

    def __init__(self, stage: RetrievalStage, prepared: PreparedQuestion, channel: EventChannel[Answer]) -> None:
        self._stage = stage
        self._prepared = prepared
        self._channel = channel
        self._stripped = StrippedDeltas()

    def token(self, token_id: int, delta: str) -> None:
        piece = self._stripped.feed(delta)
        if piece:  # a token ending inside a character brings no text yet
            self._channel.push(TextEvent(piece))

    def finish(self, generation: Generation) -> None:
        self._stage.generated(self._channel)
        backend = self._stage.backend
        backend.refresh_cache_snapshot()
        self._channel.resolve(backend.pipeline.answer_of(self._prepared, generation))

    def fail(self, error: BaseException) -> None:
        self._stage.generated(self._channel)
        self._channel.reject(error)


class RetrievalStage:
    """One thread retrieving for the questions waiting, a batch at a time (see the module docstring)."""

    def __init__(self, backend: ServiceBackend, worker: ModelWorker, *, queue_size: int, max_batch: int = 4,
                 gather_s: float = DEFAULT_ADMIT_WAIT_S, name: str = "hypic-retrieval") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.backend = backend
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.worker = worker
        self.queue_size = queue_size
        self._tokenizer = copy.deepcopy(backend.pipeline.session.tokenizer)  # the worker's belongs to its thread
        self._condition = threading.Condition()
        self._pending: deque[PendingQuestion] = deque()
        self._retrieving = 0
        self._handing_over = False  # the batch being retrieved is being submitted to the scheduler
        self._generating: set[EventChannel[Answer]] = set()
        self._ended_since_batch = 0  # answers ended since the last batch was taken: their clients may come back
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.batches = 0
        """Batches retrieved so far (each one embedding call)."""

    # ----------------------------------------------------------------------------------------- counts
    @property
    def waiting(self) -> int:
        """Questions not yet handed to the scheduler."""
        return len(self._pending) + self._retrieving

    @property
    def retrieving_batch(self) -> bool:
        """Whether a batch is being retrieved whose questions have not reached the scheduler yet (the model
        worker may hold a step for their prefills: `ModelWorker.hold_steps_for`)."""
        return self._retrieving > 0 and not self._handing_over

    @property
    def generating(self) -> int:
        """Questions handed to the scheduler whose answer has not ended."""
        return len(self._generating)

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> RetrievalStage:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Refuse new questions, fail those waiting with 503, finish the batch being retrieved."""
        with self._condition:
            self._stopping = True
            pending = list(self._pending)
            self._pending.clear()
            self._condition.notify_all()
        for item in pending:
            item.channel.reject(ServiceUnavailableError("the server is shutting down; retry later"))
        if self._thread.is_alive():
            self._thread.join(30.0)

    # ----------------------------------------------------------------------------------------- submission
    def submit(self, item: PendingQuestion) -> None:
        """Queue a question; `QueueFullError` (429, Retry-After) when `queue_size` requests already wait (here,
        in the worker's queue or for admission to the batch), 503 while stopping."""
        with self._condition:
            if self._stopping:
                raise ServiceUnavailableError("the server is shutting down")
            self.worker.check_room(self.waiting)
            self._pending.append(item)
            self._condition.notify()

    def generated(self, channel: EventChannel[Answer]) -> None:
        """An answer ended (its sink calls this)."""
        self._generating.discard(channel)
        with self._condition:
            self._ended_since_batch += 1

    # ----------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._stopping:
                    self._condition.wait()
                if self._stopping:
                    return
                self._gather()
                batch = [self._pending.popleft() for _ in range(min(len(self._pending), self.max_batch))]
                self._retrieving = len(batch)
                self._handing_over = False
                self._ended_since_batch = 0
            try:
                self._retrieve(batch)
            except Exception as error:  # a bug: these questions fail, the stage goes on serving
                logger.exception("retrieving a batch of %d questions failed", len(batch))
                for item in batch:
                    item.channel.reject(error)
            finally:
                with self._condition:
                    self._retrieving = 0
                self.worker.wake()  # its questions are in the scheduler (or failed): a held step need not wait

    def _gather(self) -> None:
        """(Holding the condition, a question pending) wait up to `gather_s` while fewer questions wait than
        answers ended since the last batch."""
        deadline = time.perf_counter() + self.gather_s
        while not self._stopping and len(self._pending) < min(self._ended_since_batch, self.max_batch):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._condition.wait(remaining)

    def _retrieve(self, batch: list[PendingQuestion]) -> None:
        live: list[PendingQuestion] = []
        for item in batch:
            try:
                item.channel.context.check()  # its deadline passed or its client went away while it waited
            except ServiceError as error:
                item.channel.reject(error)
                continue
            item.channel.context.started_at = time.perf_counter()
            live.append(item)
        if not live:
            return
        pipeline = self.backend.pipeline
        with self.backend.index_lock:
            self.backend.follow_index_writer()  # a reader sees what the index's owner committed before now
            prepared = pipeline.prepare_many([item.question for item in live], tokenizer=self._tokenizer)
        self.batches += 1
        self._handing_over = True  # the worker steps once they are submitted (`wake` in `_run`), not before
        scheduler = self.backend.scheduler
        for item, outcome in zip(live, prepared):
            if isinstance(outcome, Exception):
                item.channel.reject(BadRequestError(str(outcome), param="question") if isinstance(
                    outcome, ValueError) else outcome)
                continue
            item.channel.push(SourcesEvent(outcome.sources))
            self._generating.add(item.channel)
            try:
                scheduler.submit(outcome.request, outcome.mode, item.params,
                                 sink=AnswerSink(self, outcome, item.channel), check=item.channel.context.check,
                                 policy=outcome.policy)
            except Exception as error:  # the scheduler stopped (shutdown)
                self.generated(item.channel)
                item.channel.reject(error if isinstance(error, ServiceError)
                                    else ServiceUnavailableError("the server is shutting down; retry later"))
