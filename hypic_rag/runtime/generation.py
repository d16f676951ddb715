"""What a generation produces: the streamed (token, text delta) pairs, and the final `Generation`.

`Engine.stream` returns a `GenerationStream`; iterate it for ``(token_id, text_delta)`` pairs, then read `.result`
(the `Generation`). The deltas add up exactly to `Generation.text`: text that may still become a stop string, or
that ends inside a multi-byte character, is held back until the next token settles it (`settled_length`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hypic_rag.streaming import ResultStream

if TYPE_CHECKING:
    from hypic_rag.runtime.engine import PrefillStats
    from hypic_rag.runtime.sampling import TokenLogprob


@dataclass(slots=True)
class Generation:
    """token_ids: the generated tokens (stop tokens excluded); text: their text, cut before the first stop string;
    finish_reason: "stop" or "length"; prefill: the prefill's `PrefillStats`; timings in seconds; logprobs: one
    `TokenLogprob` per generated token when the sampling parameters asked for them (None otherwise)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prefill: PrefillStats
    time_to_first_token: float
    total_seconds: float
    timings: dict[str, float] = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None

    def usage(self) -> dict[str, int]:
        """Token accounting as the service and the integrations report it.

        cached_tokens: reused from before this request (segment-cache hits and prefix checkpoints);
        encoded_tokens: from segment entries encoded during this request (and stored for later ones);
        recomputed_tokens: run through the model while assembling (seams, question, misses in prefix mode).
        The three add up to prompt_tokens. cache_hits / cache_misses count segments.
        """
        prefill = self.prefill
        return {
            "prompt_tokens": prefill.prompt_tokens,
            "cached_tokens": prefill.cached_tokens + prefill.prefix_reused_tokens,
            "encoded_tokens": prefill.encoded_tokens,
            "recomputed_tokens": prefill.recomputed_tokens,
            "completion_tokens": len(self.token_ids),
            "cache_hits": prefill.cache_hits,
            "cache_misses": prefill.cache_misses,
        }


class GenerationStream(ResultStream[tuple[int, str], Generation]):
    """What `Engine.stream` returns: iterates ``(token_id, text_delta)``; `.result` is the `Generation` once the
    stream has ended; `.close()` stops generating early.

    The check given to `Engine.stream` (a deadline, a cancellation) runs before every step and before each
    segment the prefill encodes; what it raises stops the generation there.
    """


def settled_length(text: str, emitted: int, stop_strings: tuple[str, ...]) -> int:
    """How much of `text` (already `emitted` characters out) can be streamed now: not a trailing incomplete
    character (decoded as U+FFFD) nor a trailing part that may grow into a stop string."""
    end = len(text)
    while end > emitted and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stop_strings:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                end = min(end, len(text) - size)
                break
    return max(end, emitted)


def first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    positions = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(positions) if positions else None
