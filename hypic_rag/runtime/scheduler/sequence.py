"""One request inside the scheduler: `Sequence`, its phases, and where its tokens and outcome go (`SequenceSink`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hypic_rag.entry.schema import Entry
from hypic_rag.errors import HypicError
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.engine import Generating, PrefillPlan
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.get_or_encode import SegmentKey
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams

WAITING, ENCODING, READY, RUNNING, FINISHED = "waiting", "encoding", "ready", "running", "finished"
"""A sequence's phases: waiting for admission; admitted, its cold segments being encoded; admitted with every entry
(its prefill planned, waiting for a step with room); decoding; done (finished, failed or cancelled)."""

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
    assembly: Assembly
    params: SamplingParams
    sink: SequenceSink
    check: Callable[[], None] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)
    phase: str = WAITING
    admitted_at: float | None = None
    missing: list[SegmentKey] = field(default_factory=list)
    provided: dict[SegmentKey, Entry] = field(default_factory=dict)
    encode_seconds: float = 0.0
    generating: Generating | None = None
    """The generation as the engine's step function advances it (planned when it is ready for its prefill)."""
    _cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def mode(self) -> str:
        return self.assembly.mode

    @property
    def plan(self) -> PrefillPlan | None:
        """Its prefill plan, until the prefill has run."""
        return None if self.generating is None else self.generating.plan

    @property
    def state(self) -> SequenceState | None:
        """Its running state, once prefilled (None once it has ended)."""
        return None if self.generating is None else self.generating.state

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
        self.generating = None
        self.provided = {}
        self.missing = []
