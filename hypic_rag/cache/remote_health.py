"""Whether the remote tier is worth asking now, and warnings about it at a bounded rate.

A failing remote must cost little: after a failure the tier is *down* (every lookup is a miss at once, every
write is dropped) and *cooling down* for `cooldown_s`, doubled after each further failure up to `max_cooldown_s`;
once a cool-down is over the tier's owner may probe it (`remote_tier.RemoteTier` does, on a background thread),
and a success ends the outage. Warnings go to the ``hypic_rag.cache`` loggers at most
once per `warn_interval_s`; failures in between are counted and named in the next warning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class RemoteHealth:
    """A circuit breaker with rate-limited warnings. Thread-safe. `clock` is for tests (monotonic seconds)."""

    def __init__(
        self, name: str, *, cooldown_s: float, max_cooldown_s: float, warn_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._base_cooldown = cooldown_s
        self._max_cooldown = max_cooldown_s
        self._warn_interval = warn_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cooldown = cooldown_s
        self._down_until = 0.0
        self._next_warning = 0.0
        self._unreported = 0
        self.failures = 0
        self.last_error: str | None = None

    def available(self) -> bool:
        """False while cooling down after a failure (not even a probe should go out)."""
        return self._clock() >= self._down_until

    @property
    def down(self) -> bool:
        """True from a failure until the next success."""
        return self.last_error is not None

    def succeeded(self) -> None:
        """A call worked: the cool-down ends (logged once when the remote was down)."""
        with self._lock:
            if self.last_error is None:
                return
            self.last_error = None
            self._cooldown = self._base_cooldown
            self._down_until = 0.0
        log.warning("remote cache %s is reachable again", self.name)

    def failed(self, what: str, reason: str) -> None:
        """A call failed (`what`: the operation, `reason`: one line): cool down, warn unless warned recently."""
        with self._lock:
            now = self._clock()
            self.failures += 1
            self.last_error = reason
            if now < self._down_until:  # a call that was already under way when the remote went down
                self._unreported += 1
                return
            self._down_until = now + self._cooldown
            pause = self._cooldown
            self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            if now < self._next_warning:
                self._unreported += 1
                return
            self._next_warning = now + self._warn_interval
            unreported, self._unreported = self._unreported, 0
        more = f"; {unreported} more failures since the last warning" if unreported else ""
        log.warning(
            "remote cache %s failed (%s: %s); its lookups are misses and its writes are dropped, next try in %.0f s%s",
            self.name, what, reason, pause, more,
        )
