"""The scheduler's limits: `SchedulerConfig`."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_RUNNING = 16
DEFAULT_STEP_TOKENS = 2048
DEFAULT_MAX_WAITING = 256
DEFAULT_ENCODE_TOKENS = 1024
DEFAULT_ADMIT_WAIT_S = 0.02


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How much one scheduler step takes on (docs/runtime.md, "Continuous batching").

    max_running: sequences admitted at once (encoding their cold segments, prefilling or decoding); the rest wait,
    first come first served. step_tokens: tokens one step runs through the model: one decode token per running
    sequence, then the recomputed tokens (seams, question; the whole prompt in `full`) of newly admitted
    prefills while they fit (a step always takes at least one prefill, whatever its size, so none starves).
    max_waiting: sequences that may wait for admission before `submit` raises `SchedulerFullError` (None: no
    limit, for a caller that bounds its own queue, as the service does). encode_tokens: tokens of cold segments
    (entries the cache lacks) encoded per step, batched across the admitted requests; a request with more waits
    for later steps, so running sequences keep decoding while a long one is encoded. admit_wait_s: when the
    previous step freed slots (sequences finished) and fewer requests wait than there are free slots, the next
    step waits up to this long (from the end of that step) for more to arrive before it admits, so that their
    prefills run together in one pass (a client answered in that step usually sends its next request within
    milliseconds; prefills of several requests in one pass cost much less than one step each, and every running
    sequence decodes once per step, however many steps the prefills take). It returns as soon as the free slots
    are taken; 0 turns it off. The first request to reach an idle scheduler waits as long for the rest of its
    burst (a lone request's time to first token grows by at most this). Only the scheduler's own thread waits.
    """

    max_running: int = DEFAULT_MAX_RUNNING
    step_tokens: int = DEFAULT_STEP_TOKENS
    max_waiting: int | None = DEFAULT_MAX_WAITING
    encode_tokens: int = DEFAULT_ENCODE_TOKENS
    admit_wait_s: float = DEFAULT_ADMIT_WAIT_S

    def __post_init__(self) -> None:
        for name in ("max_running", "step_tokens", "encode_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.admit_wait_s, bool) or not isinstance(self.admit_wait_s, (int, float)) or not (
            0 <= self.admit_wait_s <= 10
        ):
            raise ValueError(f"admit_wait_s must be a number of seconds in [0, 10], got {self.admit_wait_s!r}")
        if self.max_waiting is not None and (
            isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 0
        ):
            raise ValueError(f"max_waiting must be an integer >= 0 or None, got {self.max_waiting!r}")
        if self.step_tokens < self.max_running:
            raise ValueError(
                f"step_tokens ({self.step_tokens}) must be at least max_running ({self.max_running}): every running "
                "sequence decodes one token per step"
            )
