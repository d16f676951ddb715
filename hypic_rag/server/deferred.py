"""`Deferred`: a model-worker task's result that arrives after the task's function has returned.

A completion task lays out its prompt, hands its generations to the scheduler and returns a `Deferred`;
the scheduler's sinks settle it from the model worker thread when the generations end, and the worker then
completes the task (`worker.py`). Everything here runs in that one thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

Settled = Callable[[Any, BaseException | None], None]


class Deferred(Generic[T]):
    """Settled once: `resolve(value)` or `reject(error)`; callbacks added with `on_settle` run then (or at once
    when it has already settled). Later settlements are ignored."""

    def __init__(self) -> None:
        self.settled = False
        self.value: T | None = None
        self.error: BaseException | None = None
        self._callbacks: list[Settled] = []

    def resolve(self, value: T) -> None:
        self._settle(value, None)

    def reject(self, error: BaseException) -> None:
        self._settle(None, error)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        if self.settled:
            return
        self.settled, self.value, self.error = True, value, error
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(value, error)

    def on_settle(self, callback: Settled) -> None:
        if self.settled:
            callback(self.value, self.error)
        else:
            self._callbacks.append(callback)

    def then(self, function: Callable[[T], U]) -> Deferred[U]:
        """A `Deferred` of `function(value)` (rejected with this one's error, or with what `function` raises)."""
        mapped: Deferred[U] = Deferred()

        def settle(value: Any, error: BaseException | None) -> None:
            if error is not None:
                mapped.reject(error)
                return
            try:
                result = function(value)
            except Exception as failure:  # noqa: BLE001 - handed to the task's waiter
                mapped.reject(failure)
            else:
                mapped.resolve(result)

        self.on_settle(settle)
        return mapped

    @staticmethod
    def gather(parts: Sequence[Deferred[T]], on_reject: Callable[[], None] | None = None) -> Deferred[list[T]]:
        """A `Deferred` of every part's value, in order, once all have resolved; rejected by the first part that is
        (`on_reject` then runs, e.g. to stop the other parts)."""
        gathered: Deferred[list[T]] = Deferred()
        values: list[Any] = [None] * len(parts)
        remaining = [len(parts)]
        if not parts:
            gathered.resolve([])

        def settle_part(number: int) -> Settled:
            def settle(value: Any, error: BaseException | None) -> None:
                if gathered.settled:
                    return
                if error is not None:
                    gathered.reject(error)
                    if on_reject is not None:
                        on_reject()
                    return
                values[number] = value
                remaining[0] -= 1
                if remaining[0] == 0:
                    gathered.resolve(values)

            return settle

        for number, part in enumerate(parts):
            part.on_settle(settle_part(number))
        return gathered
