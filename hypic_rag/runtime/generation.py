"""What a generation produces: the streamed (token, text delta) pairs, and the final `Generation`.

`Engine.stream` returns a `GenerationStream`; iterate it for ``(token_id, text_delta)`` pairs, then read `.result`
(the `Generation`). The deltas add up exactly to `Generation.text`: text that may still become a stop string, or
that ends inside a multi-byte character, is held back until the next token settles it (`settled_length`).
`GenerationProgress` is one generation's token loop (choose, stop, stream text), driven by whoever computes the
logits: `Engine.stream` one sequence at a time, the scheduler many per batched step.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hypic_rag.runtime.sampling import SamplingParams, choose_token, sampling_generator, token_logprobs
from hypic_rag.utils.streaming import ResultStream

if TYPE_CHECKING:
    from hypic_rag.runtime.sampling import TokenLogprob


@dataclass(slots=True)
class PrefillStats:
    """Token accounting and timings (seconds) of one prefill.

    prompt_tokens = cached_tokens + encoded_tokens + recomputed_tokens + prefix_reused_tokens, where
    cached_tokens come from segment entries that existed before this prefill (cache hits), encoded_tokens from
    entries this prefill had to encode (cache misses), recomputed_tokens ran through the model in the assembly
    pass (seams, question, full/prefix mode) and prefix_reused_tokens came from a prefix-mode checkpoint.
    segment_reused_tokens: per segment of the request (`Request.segments`), its tokens taken from an entry held
    before this prefill or from a prefix checkpoint (0 for a segment encoded now, and in `full` mode).
    segment_recomputed_tokens: per segment, its tokens run through the model in the assembly pass: always its first
    ones (a `hypic` chunk's seam, a chunk recomputed whole, every token in `full` mode); the segment's other tokens
    come from its entry (held before, or encoded now) or a prefix checkpoint. The question is recomputed whole.
    """

    mode: str
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    encoded_tokens: int = 0
    prefix_reused_tokens: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_bytes_loaded: int = 0
    load_seconds: float = 0.0
    encode_seconds: float = 0.0
    compose_seconds: float = 0.0
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    segment_reused_tokens: list[int] = field(default_factory=list)
    segment_recomputed_tokens: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


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


def without_lead(decoded: str, lead: str) -> str:
    """The text of `decoded` (the generated tokens' text so far) with `lead` (the whitespace taken off the prompt's
    end, `Request.answer_lead`) left out of its start: "" while `decoded` may still grow into `lead`; `decoded`
    itself once it does not start with it (what is settled stays settled as tokens are added)."""
    if not lead or decoded.startswith(lead):
        return decoded[len(lead):]
    return "" if lead.startswith(decoded) else decoded


def first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    positions = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(positions) if positions else None


class GenerationProgress:
    """One generation's token loop, fed one logits vector per step: chooses the token (its own seeded generator),
    stops at an end-of-sequence or stop token, a stop string or `max_new_tokens`, and cuts the text deltas.

    `advance(logits)` returns the (token_id, text_delta) to stream, or None when nothing is streamed for that token
    (a stop token with no held text, a stop string right at the start of the new text); `finished` then says
    whether generation ended. The deltas add up exactly to the final text (see `Engine.stream`).
    """

    def __init__(
        self, params: SamplingParams, eos_token_ids: Collection[int], tokenizer: Any, began: float,
        answer_lead: str = "",
    ) -> None:
        self.params = params
        self.answer_lead = answer_lead
        self.began = began
        self.tokenizer = tokenizer
        self.stop_ids = set(params.stop_token_ids) | set(eos_token_ids)
        self.generator = sampling_generator(params.seed)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.decoded = ""
        self.finish_reason = "length"
        self.finished = False
        self.first_token_at: float | None = None
        self.steps = 0

    def advance(self, logits: torch.Tensor) -> tuple[int, str] | None:
        """Choose the next token from `logits` [vocab]; the item to stream, if any."""
        if self.finished:
            raise RuntimeError("the generation has finished")
        params = self.params
        token = choose_token(logits, params, self.generator, self.token_ids)
        self.steps += 1
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter() - self.began
        if token in self.stop_ids:
            self.finish_reason, self.finished = "stop", True
            if len(self.decoded) > len(self.text):  # text held back for a stop string that never came
                delta = self.decoded[len(self.text) :]
                self.text += delta
                return token, delta
            return None
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(token_logprobs(logits, token, params.logprobs or 0))
        tokenizer = self.tokenizer
        decoded = tokenizer.decode(self.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
        self.decoded = without_lead(decoded, self.answer_lead)
        hit = first_stop(self.decoded, params.stop_strings)
        if hit is not None:
            delta = self.decoded[len(self.text) : hit]  # text was held back from where a stop string may start
            self.text += delta
            self.finish_reason, self.finished = "stop", True
            return (token, delta) if delta else None
        last = self.steps == params.max_new_tokens
        ready = len(self.decoded) if last else settled_length(self.decoded, len(self.text), params.stop_strings)
        delta = self.decoded[len(self.text) : ready]
        self.text += delta
        self.finished = last
        return token, delta

    def generation(self, prefill: PrefillStats) -> Generation:
        """The `Generation` so far (call once finished), with `prefill`'s stats and timings."""
        total = time.perf_counter() - self.began
        first = self.first_token_at if self.first_token_at is not None else total
        return Generation(
            token_ids=self.token_ids,
            text=self.text,
            finish_reason=self.finish_reason,
            prefill=prefill,
            time_to_first_token=first,
            total_seconds=total,
            logprobs=self.logprobs,
            timings={
                "cache_load": prefill.load_seconds,
                "encode": prefill.encode_seconds,
                "compose": prefill.compose_seconds,
                "prefill": prefill.prefill_seconds,
                "time_to_first_token": first,
                "total": total,
            },
        )
