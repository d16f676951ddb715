"""Continuous batching: `Scheduler` runs many requests' generations on one engine, a batched step at a time.

Requests enter a waiting queue (`submit`; `stream` and `generate` wrap it). Each `step`:
1. drops the sequences whose check raises (deadline, client gone) or that were cancelled; their state is freed;
2. admits waiting sequences, first come first served, while fewer than `max_running` are admitted (right after a
   step that freed slots, or when work arrives at an idle scheduler, it first waits up to `admit_wait_s` for
   more requests (the freed slots' clients' next ones, the rest of a burst), so that their prefills share one
   pass); an admitted
   request whose segment entries the cache lacks encodes them first, `encode_tokens` per step, batched across
   requests (`Engine.encode_segments`); entries are kept in the segment source as they are encoded;
3. runs ONE batched pass (`runtime.batch.run_batch`): one decode token for every running sequence, then the
   recomputed tokens of admitted prefills (`Engine.plan_prefill`, any mode, under the request's recompute policy)
   while they fit in `step_tokens`. A model the batched pass does not cover (`batch.batch_supported`: only the
   Qwen family batches) runs the same items one at a time through `run_stack` (`batch.run_each`), so every family
   is served, by the same scheduling, without the batching speed-up;
4. chooses each sequence's next token (`GenerationProgress`: its own sampler, stop tokens and strings) and hands
   it to the sequence's sink; finished sequences leave at once.
Every sequence gets exactly the tokens it would get alone (`tests/runtime/test_batching.py`).

`step` is called by one thread at a time: the scheduler's own (`start`) or an owner that drives it (the service's
model worker). `lock` is held during a step; hold it to use the engine from another thread between steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypic_rag.entry import Entry, check_seam_tokens
from hypic_rag.runtime.batch import BatchItem, BatchItemResult, batch_supported, run_batch, run_each
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.generation import Generation, GenerationProgress, GenerationStream
from hypic_rag.runtime.modes import mode_spec
from hypic_rag.runtime.recompute_policy import RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.stack import Span, StackResult
from hypic_rag.scheduler.config import SchedulerConfig
from hypic_rag.scheduler.handles import QueueSink
from hypic_rag.scheduler.sequence import (
    ENCODING,
    READY,
    RUNNING,
    WAITING,
    SchedulerFullError,
    SchedulerStopped,
    SegmentKey,
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


class Scheduler:
    """Batches the generations of many requests on `engine` (see the module docstring).

    on_step: called after every step with its `StepReport` (metrics), in the stepping thread.
    """

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
        *,
        on_step: Callable[[StepReport], None] | None = None,
        name: str = "hypic-scheduler",
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
        self.batched = batch_supported(engine.model)
        """Whether steps run as one batched pass (else item by item: `batch.run_each`)."""

    # ----------------------------------------------------------------------------------------- submission
    def submit(
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        *,
        sink: SequenceSink,
        check: Callable[[], None] | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> Sequence:
        """Queue a generation (thread-safe); its tokens and outcome go to `sink`. `check` runs before every step
        while it is in the scheduler; `policy`: what a `hypic` prefill recomputes (None: the engine's). Raises
        `UnknownModeError` / ValueError for a bad mode or seam width, `RecomputePolicyError` for a bad policy spec,
        `SchedulerFullError` when `max_waiting` sequences already wait, `SchedulerStopped` after `stop`."""
        mode_spec(mode)
        if seam_tokens is not None:
            check_seam_tokens(seam_tokens)
        sequence = Sequence(request, mode, params or SamplingParams(), seam_tokens, sink, check,
                            policy=as_policy(policy))
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
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        *,
        check: Callable[[], None] | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> GenerationStream:
        """`Engine.stream` through the scheduler: a `GenerationStream` of (token_id, text_delta), `.result` the
        `Generation`; closing it cancels the sequence. Someone must be stepping (`start`, or an owner thread)."""
        sink = QueueSink()
        sequence = self.submit(request, mode, params, seam_tokens, sink=sink, check=check, policy=policy)
        return GenerationStream(sink.steps(sequence))

    def generate(
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        *,
        check: Callable[[], None] | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> Generation:
        """`stream` run to its end: the `Generation` (blocks until the scheduler has produced it)."""
        return self.stream(request, mode, params, seam_tokens, check=check, policy=policy).run()

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
        items, owners = self._compose_batch()
        if not items and not encoded:
            return None
        prefills = sum(sequence.phase == READY for sequence in owners)
        tokens = sum(sum(span.recompute for span in item.spans) for item in items)
        if items:
            try:
                results: list[Any] = (run_batch if self.batched else run_each)(self.engine.model, items)
            except Exception as error:
                logger.exception("a batched step of %d sequences failed", len(items))
                for sequence in owners:
                    self._fail(sequence, error)
                results = []
            for sequence, result in zip(owners, results):
                self._advance(sequence, result)
        self.steps += 1
        if any(sequence.done for sequence in owners):
            self._freed_at = time.perf_counter()
        report = StepReport(
            sequences=len(items), tokens=tokens, prefills=prefills, decodes=len(items) - prefills,
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
        fills at once, and an owner that drives `step` itself (the service's worker) submits between its steps, in
        the same thread, so it gathers arrivals its own way."""
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
        spec = mode_spec(sequence.mode)
        if not spec.uses_entries:
            return []
        keys = self.engine.segment_entry_keys(sequence.request, sequence.mode, sequence.seam_tokens, sequence.policy)
        by_seam: dict[int, list[list[int]]] = {}
        for key in keys:
            if key is not None:  # None: a chunk the policy recomputes whole reads no entry
                by_seam.setdefault(key[0], []).append(list(key[1]))
        missing: dict[SegmentKey, None] = {}
        source = self.engine.segment_source
        for entry_seam, group in by_seam.items():
            for segment in source.missing_segments(group, entry_seam):
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
        for seam, keys in by_seam.items():
            began = time.perf_counter()
            try:
                entries = self.engine.encode_segments([list(ids) for _, ids in keys], seam)
            except Exception as error:
                logger.exception("encoding %d segments failed", len(keys))
                for key in keys:
                    for sequence in tasks[key]:
                        self._fail(sequence, error)
                continue
            self._keep(seam, keys, entries)
            seconds = time.perf_counter() - began
            tokens = sum(len(ids) for _, ids in keys)
            for key, entry in zip(keys, entries):
                for sequence in tasks[key]:
                    sequence.provided[key] = entry
                    sequence.encode_seconds += seconds * len(key[1]) / tokens
        for sequence in self._active:
            if sequence.phase == ENCODING and all(key in sequence.provided for key in sequence.missing):
                sequence.phase = READY
        return total

    def _keep(self, seam: int, keys: list[SegmentKey], entries: list[Entry]) -> None:
        """Hand freshly encoded entries to the segment source (a failed write only costs a later re-encode)."""
        by_ids = {ids: entry for (_, ids), entry in zip(keys, entries)}
        try:
            self.engine.segment_source.get_or_encode_segments(
                [list(ids) for ids in by_ids], seam, lambda missing: [by_ids[tuple(ids)] for ids in missing]
            )
        except Exception:
            logger.warning("keeping %d encoded segment entries failed", len(by_ids), exc_info=True)

    def _compose_batch(self) -> tuple[list[BatchItem], list[Sequence]]:
        """One decode item per running sequence, then planned prefills, in admission order, while they fit."""
        items: list[BatchItem] = []
        owners: list[Sequence] = []
        budget = self.config.step_tokens
        for sequence in self._active:
            if sequence.phase == RUNNING:
                state = sequence.state
                assert state is not None and sequence.progress is not None
                items.append(BatchItem([Span([sequence.progress.token_ids[-1]], state.length, 1)], state))
                owners.append(sequence)
                budget -= 1
        prefills = 0
        for sequence in list(self._active):
            if sequence.phase != READY:
                continue
            if sequence.plan is None and not self._plan(sequence):
                continue
            plan = sequence.plan
            assert plan is not None
            if prefills and plan.recomputed_tokens > budget:
                break  # first come first served: later requests do not jump ahead of this one
            items.append(BatchItem(plan.spans, plan.initial, plan.options, plan.want_checkpoints,
                                   reserve=sequence.params.max_new_tokens))
            owners.append(sequence)
            budget -= plan.recomputed_tokens
            prefills += 1
        return items, owners

    def _plan(self, sequence: Sequence) -> bool:
        """Plan the sequence's prefill (entries fetched now); False when it failed (the sequence has left)."""
        try:
            plan = self.engine.plan_prefill(
                sequence.request, sequence.mode, sequence.seam_tokens, check=sequence.check, policy=sequence.policy,
                provided=sequence.provided,
            )
        except Exception as error:  # its check, a bad request, a cache failure: this sequence ends
            self._fail(sequence, error)
            return False
        plan.began = sequence.admitted_at or plan.began
        plan.stats.encode_seconds += sequence.encode_seconds
        sequence.plan, sequence.provided = plan, {}
        return True

    def _advance(self, sequence: Sequence, result: BatchItemResult | StackResult) -> None:
        """Take the sequence's logits from the step: its prefill ends (it starts decoding), a token is chosen and
        handed to its sink, and a finished sequence leaves."""
        try:
            if sequence.phase == READY:
                assert sequence.plan is not None
                prefill = self.engine.finish_prefill(sequence.plan, result)
                sequence.stats, sequence.plan = prefill.stats, None
                sequence.phase = RUNNING
                model = self.engine.model
                sequence.progress = GenerationProgress(
                    sequence.params, model.eos_token_ids, model.tokenizer, sequence.submitted_at
                )
            # the batched pass advances a running sequence's state in place; `run_each` returns a new one
            sequence.state = result.state
            progress = sequence.progress
            assert progress is not None
            item = progress.advance(result.logits)
            if item is not None:
                sequence.sink.token(*item)
        except Exception as error:
            logger.debug("a sequence failed after its step", exc_info=True)
            self._fail(sequence, error)
            return
        if progress.finished:
            assert sequence.stats is not None
            generation = progress.generation(sequence.stats)
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

