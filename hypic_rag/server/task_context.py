"""`TaskContext`: what a running request may consult (its deadline, whether it was cancelled) and where it pushes
its events. A leaf of the service, imported by the worker that runs tasks, the channel that carries their events
and the backend and routes that work in them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hypic_rag.server.errors import RequestCancelledError, RequestTimeoutError
from hypic_rag.server.events import Event


@dataclass(slots=True)
class TaskContext:
    """What a running request may consult: its deadline, whether it was cancelled, and where to push its events
    (`channel.EventChannel.push`)."""

    submitted_at: float
    deadline: float
    timeout_s: float
    emit_sink: Callable[[Event], None] | None = None
    started_at: float | None = None
    cancel_event: threading.Event = field(default_factory=threading.Event)

    @property
    def queue_seconds(self) -> float:
        return (self.started_at or time.perf_counter()) - self.submitted_at

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set() or time.perf_counter() > self.deadline

    def check(self) -> None:
        """Raise if the task should stop: `RequestTimeoutError` past its deadline, `RequestCancelledError` if
        cancelled."""
        if time.perf_counter() > self.deadline:
            raise RequestTimeoutError(f"request timed out after {self.timeout_s:g} s")
        if self.cancel_event.is_set():
            raise RequestCancelledError("request cancelled")

    def emit(self, event: Event) -> None:
        if self.emit_sink is not None:
            self.emit_sink(event)
