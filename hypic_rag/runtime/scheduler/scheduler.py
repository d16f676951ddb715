"""Continuous batching: `Scheduler` runs many requests' generations on one engine, a batched step at a time.

Requests enter a waiting queue (`submit`; `stream` and `generate` wrap it). Each `step`:
1. drops the sequences whose check raises (deadline, client gone) or that were cancelled; their state is freed;
2. admits waiting sequences, first come first served, while fewer than `max_running` are admitted (right after a
   step that freed slots, or when work arrives at an idle scheduler, it first waits up to `admit_wait_s` for
   more requests (the freed slots' clients' next ones, the rest of a burst), so that their prefills share one
   pass); an admitted
   request whose segment entries the cache lacks encodes them first, `encode_tokens` per step, batched across
   requests, and keeps them in the segment source as they are encoded (`Engine.entries`, the get-or-encode home);
3. runs ONE batched pass, the engine's step function (`Engine.step`: `runtime.stack.run_batch`, for every
   family): one decode token for every running sequence, then the recomputed tokens of admitted prefills
   (`Engine.plan_prefill`, any mode, under the request's assembly) while they fit in `step_tokens`;
4. each sequence takes its logits (`Engine.take`: its own sampler, stop tokens and strings) and hands its token
   to the sequence's sink; finished sequences leave at once.
Every sequence gets exactly the tokens it would get alone (`tests/runtime/test_batching.py`, every family:
`tests/runtime/test_batching_families.py`).

`step` is called by one thread at a time: the scheduler's own (`start`), an owner that drives it (the service's
model worker), or, when neither, the consumer of a `stream` (the pipeline's answers: one sequence per step). `lock`
is held during a step; hold it to use the engine from another thread between steps.

A scheduler's own thread is a daemon (it never keeps a process alive), and it is stopped at interpreter exit
(`atexit`: the step in progress completes, sequences left fail with `SchedulerStopped`): a daemon thread still
inside a torch op when Python finalizes is ended by `pthread_exit`, whose unwinding through torch's C++ frames
aborts the process ("terminate called without an active exception", SIGABRT; seen when a process exited with a
`HypicLLM` stream abandoned or a generation still running).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hypic_rag.runtime.engine import AssemblyLike, Engine, Generating
from hypic_rag.runtime.generation import Generation, GenerationStream
from hypic_rag.runtime.get_or_encode import SegmentKey
from hypic_rag.runtime.recompute_policy import WHOLE, RecomputePolicy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.stack import StackItemResult
from hypic_rag.runtime.scheduler.config import SchedulerConfig
from hypic_rag.runtime.scheduler.handles import QueueSink
from hypic_rag.runtime.scheduler.sequence import (
    ENCODING,
    READY,
    RUNNING,
    WAITING,
    SchedulerFullError,
    SchedulerStopped,
    Sequence,
    SequenceCancelled,
    SequenceSink,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step: sequences and tokens in its batched pass (prefills' recomputed tokens plus one per decode), how
    many were prefills and decodes, cold-segment tokens encoded, sequences running and waiting after it, seconds."""

    sequences: int
    tokens: int
    prefills: int
    decodes: int
    encoded_tokens: int
    running: int
    waiting: int
    seconds: float


_THREADED: weakref.WeakSet[Scheduler] = weakref.WeakSet()
"""Schedulers whose own thread was started (`Scheduler.start`): stopped at interpreter exit."""
EXIT_STOP_TIMEOUT_S = 60.0
"""How long exit waits for a scheduler's step in progress."""


@atexit.register
def _stop_threads_at_exit() -> None:
    """Stop every started scheduler's thread before Python finalizes (see the module docstring)."""
    for scheduler in list(_THREADED):
        scheduler.stop(EXIT_STOP_TIMEOUT_S)


class Scheduler:
    """Batches the generations of many requests on `engine` (see the module docstring).

    on_step: called after every step with its `StepReport` (metrics), in the stepping thread.
    """

    def __init__(
        self, engine: Engine, config: SchedulerConfig | None = None, *,
        on_step: Callable[[StepReport], None] | None = None, name: str = "hypic-scheduler",
    ) -> None:
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.on_step = on_step
        self.lock = threading.RLock()
        self._condition = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._active: list[Sequence] = []
        self._name = name
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.steps = 0
        self._freed_at: float | None = None
        """When the last step that freed slots (finished sequences) ended, or idle `_loop` got work; None once
        admission has used it."""

    # ----------------------------------------------------------------------------------------- submission
    def submit(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None, *,
        sink: SequenceSink, check: Callable[[], None] | None = None, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> Sequence:
        """Queue a generation (thread-safe); its tokens and outcome go to `sink`. `assembly`: an `Assembly` or a
        mode name (`seam_tokens` / `policy` override it; what it leaves open is the engine's). `check` runs before
        every step while it is in the scheduler. Raises `UnknownModeError` / ValueError for a bad mode or seam
        width, `RecomputePolicyError` for a bad policy spec, `SchedulerFullError` when `max_waiting` sequences
        already wait, `SchedulerStopped` after `stop`."""
        chosen = self.engine.assembly(mode, seam_tokens=seam_tokens, policy=policy)
        sequence = Sequence(request, chosen, params or SamplingParams(), sink, check)
        with self._condition:
            if self._stopping:
                raise SchedulerStopped("the scheduler has stopped")
            limit = self.config.max_waiting
            if limit is not None and len(self._waiting) >= limit:
                raise SchedulerFullError(f"the scheduler's waiting queue is full ({limit} waiting); retry later")
            self._waiting.append(sequence)
            self._condition.notify_all()
        return sequence

    def stream(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None, *,
        check: Callable[[], None] | None = None, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> GenerationStream:
        """A generation through the scheduler: a `GenerationStream` of (token_id, text_delta), `.result` the
        `Generation`; closing it cancels the sequence. Its steps run in the scheduler's thread once `start`ed (or
        in an owner's that drives `step`); while neither, in the consumer's own thread as it iterates (a single
        request is then the scheduler with one sequence)."""
        sink = QueueSink()
        sequence = self.submit(request, mode, params, sink=sink, check=check, seam_tokens=seam_tokens,
                               policy=policy)
        return GenerationStream(sink.steps(sequence, drive=self._drive_inline))

    def _drive_inline(self) -> bool:
        """One step in the caller's thread when nobody else runs steps (the scheduler was not started); False
        otherwise (the caller waits for the thread)."""
        if self._thread is not None:
            return False
        return self.step() is not None  # None: nothing left to run (the sequence has ended)

    def generate(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None, *,
        check: Callable[[], None] | None = None, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> Generation:
        """`stream` run to its end: the `Generation` (blocks until the scheduler has produced it)."""
        return self.stream(request, mode, params, check=check, seam_tokens=seam_tokens, policy=policy).run()

    # ----------------------------------------------------------------------------------------- introspection
    @property
    def waiting(self) -> int:
        """Sequences waiting for admission."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Sequences admitted (encoding their segments, waiting for their prefill, or decoding)."""
        return len(self._active)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._active)

    # ----------------------------------------------------------------------------------------- the thread
    def start(self) -> Scheduler:
        """Run steps in a thread of its own whenever there is work (idempotent)."""
        with self._condition:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
                _THREADED.add(self)
        return self

    def stop(self, timeout_s: float | None = 30.0) -> None:
        """Stop the thread (the step in progress completes) and fail every sequence left with `SchedulerStopped`."""
        with self._condition:
            self._stopping = True
            self._condition.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self.lock:
            self.fail_all(SchedulerStopped("the scheduler stopped before this generation finished"))

    def _loop(self) -> None:
        while True:
            with self._condition:
                idle = not self.has_work
                while not self._stopping and not self.has_work:
                    self._condition.wait()
                if self._stopping:
                    return
            if idle:  # a burst starts: its first requests are gathered as after freed slots
                self._freed_at = time.perf_counter()
            try:
                self.step()
            except Exception:  # a bug: the step's sequences were failed with it; keep serving the others
                logger.exception("scheduler step failed")

    def fail_all(self, error: BaseException) -> None:
        """End every waiting and admitted sequence with `error` (shutdown)."""
        with self._condition:
            sequences = list(self._waiting) + list(self._active)
            self._waiting.clear()
        for sequence in sequences:
            self._fail(sequence, error)

    # ----------------------------------------------------------------------------------------- a step
    def step(self) -> StepReport | None:
        """One step (see the module docstring); None when there was nothing to do."""
        with self.lock:
            return self._step()

    def _step(self) -> StepReport | None:
        began = time.perf_counter()
        self._drop_stopped()
        self._await_arrivals()
        self._admit()
        encoded = self._encode_cold_segments()
        owners = self._compose_batch()
        if not owners and not encoded:
            return None
        prefills = sum(sequence.phase == READY for sequence in owners)
        tokens = sum(sequence.generating.step_tokens for sequence in owners if sequence.generating is not None)
        if owners:
            try:
                results: list[StackItemResult] = self.engine.step([sequence.generating for sequence in owners])
            except Exception as error:
                logger.exception("a batched step of %d sequences failed", len(owners))
                for sequence in owners:
                    self._fail(sequence, error)
                results = []
            for sequence, result in zip(owners, results):
                self._advance(sequence, result)
        self.steps += 1
        if any(sequence.done for sequence in owners):
            self._freed_at = time.perf_counter()
        report = StepReport(
            sequences=len(owners), tokens=tokens, prefills=prefills, decodes=len(owners) - prefills,
            encoded_tokens=encoded, running=len(self._active), waiting=len(self._waiting),
            seconds=time.perf_counter() - began,
        )
        if self.on_step is not None:
            try:
                self.on_step(report)
            except Exception:
                logger.exception("on_step failed")
        return report

    def _drop_stopped(self) -> None:
        """Sequences cancelled by their consumer, or whose check raises, leave now."""
        with self._condition:
            sequences = list(self._waiting) + list(self._active)
        for sequence in sequences:
            if sequence.cancelled:
                self._fail(sequence, SequenceCancelled("the generation was cancelled"))
                continue
            if sequence.check is None:
                continue
            try:
                sequence.check()
            except Exception as error:  # whatever the check raises ends the sequence with it
                self._fail(sequence, error)

    def _await_arrivals(self) -> None:
        """Right after a step that freed slots (or the first arrival at an idle scheduler's thread), wait (up to
        `admit_wait_s` from then) while fewer sequences wait
        than there are free slots, so that the requests its finished sequences' clients send next are admitted
        together (their prefills in one pass). Only a batching scheduler's own thread (`start`) waits: one slot
        fills at once, and an owner that drives `step` itself decides when to step (the service's model worker
        holds a step while its retrieval stage is about to submit a batch: `server/worker.py`)."""
        freed_at, self._freed_at = self._freed_at, None
        wait = self.config.admit_wait_s
        if freed_at is None or wait <= 0 or self.config.max_running == 1 or threading.current_thread() is not self._thread:
            return
        deadline = freed_at + wait
        with self._condition:
            while not self._stopping and len(self._waiting) < self.config.max_running - len(self._active):
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return
                self._condition.wait(remaining)

    def _admit(self) -> None:
        """FCFS from the waiting queue while fewer than `max_running` sequences are admitted."""
        while len(self._active) < self.config.max_running:
            with self._condition:
                if not self._waiting:
                    return
                sequence = self._waiting.popleft()
            sequence.admitted_at = time.perf_counter()
            self._active.append(sequence)
            try:
                sequence.missing = self._missing_entries(sequence)
            except Exception:  # a lookup that fails leaves the fetching to the prefill, which reports it
                logger.warning("looking up the segments of a request failed", exc_info=True)
                sequence.missing = []
            sequence.phase = ENCODING if sequence.missing else READY

    def _missing_entries(self, sequence: Sequence) -> list[SegmentKey]:
        """The (entry seam, token ids) of the request's segment entries the segment source lacks, each once."""
        if not sequence.assembly.spec.uses_entries:
            return []
        keys = self.engine.segment_entry_keys(sequence.request, sequence.assembly)
        by_seam: dict[int, list[list[int]]] = {}
        for key in keys:
            if key is not None:  # None: a chunk the policy recomputes whole reads no entry
                by_seam.setdefault(key[0], []).append(list(key[1]))
        missing: dict[SegmentKey, None] = {}
        for entry_seam, group in by_seam.items():
            for segment in self.engine.entries.missing(group, entry_seam):
                missing[(entry_seam, tuple(segment))] = None
        return list(missing)

    def _encode_cold_segments(self) -> int:
        """Encode up to `encode_tokens` tokens of the admitted requests' missing entries (at least one segment), in
        admission order, each distinct segment once; keep them in the segment source and hand them to every
        request that needs them. Returns the tokens encoded."""
        tasks: dict[SegmentKey, list[Sequence]] = {}
        total = 0
        full = False
        for sequence in self._active:
            if sequence.phase != ENCODING:
                continue
            for key in sequence.missing:
                if key in sequence.provided:
                    continue
                if key not in tasks:
                    if full or (tasks and total + len(key[1]) > self.config.encode_tokens):
                        full = True
                        continue
                    tasks[key] = []
                    total += len(key[1])
                tasks[key].append(sequence)
        if not tasks:
            return 0
        by_seam: dict[int, list[SegmentKey]] = {}
        for key in tasks:
            by_seam.setdefault(key[0], []).append(key)
        entries = self.engine.entries
        for seam, keys in by_seam.items():
            began = time.perf_counter()
            try:
                encoded = entries.encode([ids for _, ids in keys], seam)
            except Exception as error:
                logger.exception("encoding %d segments failed", len(keys))
                for key in keys:
                    for sequence in tasks[key]:
                        self._fail(sequence, error)
                continue
            try:  # a failed write only costs a later re-encode
                # the entries as the source stores them: a compressed cache format gives a miss the values a later
                # hit gets
                encoded = entries.keep(seam, {ids: entry for (_, ids), entry in zip(keys, encoded)})
            except Exception:
                logger.warning("keeping %d encoded segment entries failed", len(keys), exc_info=True)
            seconds = time.perf_counter() - began
            tokens = sum(len(ids) for _, ids in keys)
            for key, entry in zip(keys, encoded):
                for sequence in tasks[key]:
                    sequence.provided[key] = entry
                    sequence.encode_seconds += seconds * len(key[1]) / tokens
        for sequence in self._active:
            if sequence.phase == ENCODING and all(key in sequence.provided for key in sequence.missing):
                sequence.phase = READY
        return total

    def _compose_batch(self) -> list[Sequence]:
        """Every running sequence (one decode token each), then planned prefills, in admission order, while they
        fit in `step_tokens`."""
        owners = [sequence for sequence in self._active if sequence.phase == RUNNING]
        budget = self.config.step_tokens - len(owners)
        prefills = 0
        for sequence in list(self._active):
            if sequence.phase != READY:
                continue
            if sequence.generating is None and not self._plan(sequence):
                continue
            generating = sequence.generating
            assert generating is not None
            if prefills and generating.step_tokens > budget:
                break  # first come first served: later requests do not jump ahead of this one
            owners.append(sequence)
            budget -= generating.step_tokens
            prefills += 1
        return owners

    def _plan(self, sequence: Sequence) -> bool:
        """Plan the sequence's prefill (entries fetched now); False when it failed (the sequence has left)."""
        try:
            plan = self.engine.plan_prefill(sequence.request, sequence.assembly, check=sequence.check,
                                            provided=sequence.provided)
        except Exception as error:  # its check, a bad request, a cache failure: this sequence ends
            self._fail(sequence, error)
            return False
        plan.began = sequence.admitted_at or plan.began
        plan.stats.encode_seconds += sequence.encode_seconds
        sequence.generating = Generating(sequence.params, plan, began=sequence.submitted_at)
        sequence.provided = {}
        return True

    def _advance(self, sequence: Sequence, result: StackItemResult) -> None:
        """Hand the sequence its share of the step (`Engine.take`): its prefill ends (it starts decoding), a token
        is chosen and handed to its sink, and a finished sequence leaves."""
        generating = sequence.generating
        try:
            assert generating is not None
            item = self.engine.take(generating, result)
            sequence.phase = RUNNING
            if item is not None:
                sequence.sink.token(*item)
        except Exception as error:
            logger.debug("a sequence failed after its step", exc_info=True)
            self._fail(sequence, error)
            return
        if generating.finished:
            generation = generating.generation()
            generation.timings["waiting"] = sequence.waiting_seconds
            self._leave(sequence)
            try:
                sequence.sink.finish(generation)
            except Exception:
                logger.exception("a sequence's sink failed")

    def _fail(self, sequence: Sequence, error: BaseException) -> None:
        if sequence.done:
            return
        self._leave(sequence)
        try:
            sequence.sink.fail(error)
        except Exception:
            logger.exception("a sequence's sink failed")

    def _leave(self, sequence: Sequence) -> None:
        """Take the sequence out of the queue or the running set and free its state."""
        with self._condition:
            if sequence.phase == WAITING:
                try:
                    self._waiting.remove(sequence)
                except ValueError:
                    pass
            elif sequence in self._active:
                self._active.remove(sequence)
        sequence.release()

