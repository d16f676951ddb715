"""One request inside the scheduler: `Sequence`, its phases, and where its tokens and outcome go (`SequenceSink`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hypic_rag.entry import Entry
from hypic_rag.errors import HypicError
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.engine import PrefillPlan, PrefillStats
from hypic_rag.runtime.generation import Generation, GenerationProgress
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.state import DecodeState

WAITING, ENCODING, READY, RUNNING, FINISHED = "waiting", "encoding", "ready", "running", "finished"
"""A sequence's phases: waiting for admission; admitted, its cold segments being encoded; admitted with every entry
(its prefill planned, waiting for a step with room); decoding; done (finished, failed or cancelled)."""

SegmentKey = tuple[int, tuple[int, ...]]
"""(entry seam, token ids): one segment entry a request needs."""


class SchedulerFullError(HypicError):
    """The scheduler's waiting queue is full (`SchedulerConfig.max_waiting`); retry later."""


class SequenceCancelled(HypicError):
    """The sequence was cancelled by its consumer (a closed stream, `Sequence.cancel`)."""


class SchedulerStopped(HypicError):
    """The scheduler stopped before the sequence finished."""


class SequenceSink(Protocol):
    """Where a sequence's output goes; called in the scheduler's thread, so each call must be quick."""

    def token(self, token_id: int, delta: str) -> None:
        """A generated token and the text it settles (may be "")."""

    def finish(self, generation: Generation) -> None:
        """The generation ended (stop, length): its `Generation`."""

    def fail(self, error: BaseException) -> None:
        """The generation stopped with `error` (its check raised, it was cancelled, the step failed)."""


@dataclass(eq=False, slots=True)
class Sequence:
    """A request's generation as the scheduler runs it (one per choice: a request asking for n choices is n).

    check: called before every step while the sequence is in the scheduler (a deadline, a cancellation); what it
    raises ends the sequence with that error. The sink receives tokens, then `finish` or `fail` exactly once.
    """

    request: Request
    mode: str
    params: SamplingParams
    seam_tokens: int | None
    sink: SequenceSink
    check: Callable[[], None] | None = None
    policy: Any = None
    """What a `hypic` prefill recomputes (a `RecomputePolicy`; None: the engine's)."""
    submitted_at: float = field(default_factory=time.perf_counter)
    phase: str = WAITING
    admitted_at: float | None = None
    missing: list[SegmentKey] = field(default_factory=list)
    provided: dict[SegmentKey, Entry] = field(default_factory=dict)
    encode_seconds: float = 0.0
    plan: PrefillPlan | None = None
    stats: PrefillStats | None = None
    state: SequenceState | DecodeState | None = None
    progress: GenerationProgress | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the sequence at the scheduler's next step (thread-safe; a no-op once it has ended)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def done(self) -> bool:
        return self.phase == FINISHED

    @property
    def waiting_seconds(self) -> float:
        """Time from submission to admission (so far, while it waits)."""
        return (self.admitted_at if self.admitted_at is not None else time.perf_counter()) - self.submitted_at

    def release(self) -> None:
        """Drop what the sequence holds (its state, plan and encoded entries) once it has ended."""
        self.phase = FINISHED
        self.state = None
        self.plan = None
        self.provided = {}
        self.missing = []
