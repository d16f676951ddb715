"""The engine: fetch or encode segment entries, assemble a request under one of six modes, generate.

Modes (the comparison ladder of docs/design.md, all through the same stack pass):
- full: recompute every token.
- prefix: exact reuse of the longest chunk-prefix whose boundary state was checkpointed; the rest recomputed
  (and checkpointed at each chunk boundary for later requests).
- addition: sum of zero-start states (no P), keys left at their standalone positions: the naive baseline.
- transition: P composition, keys left at their standalone positions.
- transition_rope: P composition, cached keys re-positioned with RoPE.
- hypic: transition_rope plus a recomputed seam window of `seam_tokens` at the start of every chunk.
The prefix sits at position 0 with a zero start, so its (seam-0) entry is exact in every mode; without a prefix the
first chunk's seam is recomputed from the zero start, which is exact too.
"""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.lru import ByteBudgetLRU
from hypic_rag.streaming import drain
from hypic_rag.runtime.encode import encode_segment
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.request import Request, check_mode
from hypic_rag.runtime.stack import Span, StackOptions, run_stack
from hypic_rag.runtime.state import DecodeState

logger = logging.getLogger(__name__)

Entry = dict[str, torch.Tensor]
STATE_DTYPE = "float32"


def _entry_bytes(entry: Entry) -> int:
    return sum(t.numel() * t.element_size() for t in entry.values())


@dataclass(slots=True)
class PrefillStats:
    """Token accounting and timings (seconds) of one prefill.

    prompt_tokens = cached_tokens + encoded_tokens + recomputed_tokens + prefix_reused_tokens, where
    cached_tokens come from segment entries that existed before this prefill (cache hits), encoded_tokens from
    entries this prefill had to encode (cache misses), recomputed_tokens ran through the model in the assembly
    pass (seams, question, full/prefix mode) and prefix_reused_tokens came from a prefix-mode checkpoint.
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

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class PrefillResult:
    """logits: [vocab] float32 next-token logits; state: the decode state after the prompt."""

    logits: torch.Tensor
    state: DecodeState
    stats: PrefillStats


@dataclass(slots=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    prefill: PrefillStats
    time_to_first_token: float
    total_seconds: float
    timings: dict[str, float] = field(default_factory=dict)

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


SEED_MAX = 2**64 - 1
"""Seeds are unsigned 64-bit integers (what `torch.Generator.manual_seed` takes without wrapping)."""


@dataclass(slots=True)
class SamplingParams:
    """temperature 0 means greedy (finite, >= 0; a temperature so small that only the top token keeps any
    probability samples greedily); top_p in (0, 1]; seed in [0, 2**64 - 1] makes sampling reproducible, and
    without one every generation draws fresh randomness."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            integral = isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool)
            if not integral or not 0 <= self.seed <= SEED_MAX:
                raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
            self.seed = int(self.seed)


class Engine:
    """Assembles requests for one model.

    segment_cache: a `hypic_rag.cache.segment_cache.SegmentCache` (persistent, shared across processes) or None
    for an in-process LRU of `memory_cache_bytes`.
    """

    def __init__(
        self,
        model: HybridModel,
        *,
        seam_tokens: int = 8,
        segment_cache: Any | None = None,
        memory_cache_bytes: int = 1 << 30,
        prefix_cache_bytes: int = 1 << 30,
        state_dtype: str = STATE_DTYPE,
    ) -> None:
        if seam_tokens < 0:
            raise ValueError("seam_tokens must be >= 0")
        self.model = model
        self.seam_tokens = seam_tokens
        self.segment_cache = segment_cache
        self.state_dtype = state_dtype
        self._memory_entries: ByteBudgetLRU[Entry] = ByteBudgetLRU(memory_cache_bytes, _entry_bytes)
        self._prefix_checkpoints: ByteBudgetLRU[DecodeState] = ByteBudgetLRU(prefix_cache_bytes, DecodeState.nbytes)
        self.segment_check: Callable[[], None] | None = None
        """Called before each segment is encoded (a service sets it per request); raising stops the encoding
        there, and none of that call's entries are stored."""

    # ------------------------------------------------------------------ entries

    def encode_segment(self, token_ids: list[int], seam_tokens: int | None = None) -> Entry:
        """Encode one segment standalone (positions 0..L-1); a plain dict of CPU tensors."""
        return encode_segment(self.model, list(token_ids), self.seam_tokens if seam_tokens is None else seam_tokens)

    def encode_segments(self, segments: list[list[int]], seam_tokens: int | None = None) -> list[Entry]:
        entries = []
        for segment in segments:
            if self.segment_check is not None:
                self.segment_check()
            entries.append(self.encode_segment(segment, seam_tokens))
        return entries

    def cache_namespace(self, seam_tokens: int) -> Any:
        from hypic_rag.cache.keys import CacheNamespace

        return CacheNamespace(
            model_fingerprint=self.model.fingerprint,
            tokenizer_fingerprint=self.model.tokenizer_fingerprint,
            seam_tokens=seam_tokens,
            state_dtype=self.state_dtype,
            model_dtype=self.model.dtype_name,
        )

    def fetch_entries(self, segments: list[list[int]], seam_tokens: int, stats: PrefillStats) -> list[Entry]:
        """Entries for `segments`: from the cache on a hit, encoded (and stored) on a miss."""
        return self._fetch_entries(segments, seam_tokens, stats)[0]

    def _fetch_entries(
        self, segments: list[list[int]], seam_tokens: int, stats: PrefillStats
    ) -> tuple[list[Entry], list[bool]]:
        """(entries, hit per segment): a segment missing from the cache is encoded and stored."""
        began = time.perf_counter()
        encode_seconds = 0.0

        def encode_many(missing: list[list[int]]) -> list[Entry]:
            nonlocal encode_seconds
            start = time.perf_counter()
            entries = self.encode_segments(missing, seam_tokens)
            encode_seconds += time.perf_counter() - start
            return entries

        if self.segment_cache is not None:
            entries, hits = self.segment_cache.get_or_encode_many(self.cache_namespace(seam_tokens), segments, encode_many)
            hits = [bool(hit) for hit in hits]
        else:
            entries, hits = [], []
            keys = [(seam_tokens, tuple(segment)) for segment in segments]
            found = [self._memory_entries.get(key) for key in keys]
            missing = [segment for segment, entry in zip(segments, found) if entry is None]
            encoded = iter(encode_many(missing)) if missing else iter(())
            for key, entry in zip(keys, found):
                hits.append(entry is not None)
                if entry is None:
                    entry = next(encoded)
                    self._memory_entries.put(key, entry)
                entries.append(entry)
        hit_count = sum(hits)
        device = self.model.device
        stats.cache_bytes_loaded += sum(_entry_bytes(entry) for entry in entries)
        entries = [{name: tensor.to(device, non_blocking=True) for name, tensor in e.items()} for e in entries]
        stats.cache_hits += hit_count
        stats.cache_misses += len(segments) - hit_count
        stats.encode_seconds += encode_seconds
        stats.load_seconds += time.perf_counter() - began - encode_seconds
        return entries, hits

    # ------------------------------------------------------------------ prefill

    def prefill(self, request: Request, mode: str = "hypic", seam_tokens: int | None = None) -> PrefillResult:
        """Assemble `request` under `mode`; returns next-token logits and the decode state."""
        check_mode(mode)
        seam = self.seam_tokens if seam_tokens is None else seam_tokens
        if seam < 0:
            raise ValueError("seam_tokens must be >= 0")
        began = time.perf_counter()
        stats = PrefillStats(mode=mode, prompt_tokens=request.prompt_tokens)
        if mode == "full":
            spans = [Span(request.all_ids(), 0, request.prompt_tokens)]
            result = run_stack(self.model, spans)
        elif mode == "prefix":
            result = self._prefill_prefix(request, stats)
        else:
            result = self._prefill_composed(request, mode, seam, stats)
        stats.recomputed_tokens = result.recomputed_tokens
        stats.cached_tokens = (
            request.prompt_tokens - result.recomputed_tokens - stats.prefix_reused_tokens - stats.encoded_tokens
        )
        stats.compose_seconds = result.compose_seconds
        stats.total_seconds = time.perf_counter() - began
        stats.prefill_seconds = stats.total_seconds - stats.load_seconds - stats.encode_seconds - stats.compose_seconds
        return PrefillResult(result.logits, result.state, stats)

    def _prefill_composed(self, request: Request, mode: str, seam: int, stats: PrefillStats):
        segments = request.segments
        # the prefix always sits at position 0: its seam-0 entry is exact (Z is its state). In hypic every chunk
        # recomputes its seam (the first one, when there is no prefix, from the zero start: exact as well).
        has_prefix = bool(request.prefix_ids)
        seams = [0 if mode != "hypic" or (has_prefix and number == 0) else seam for number in range(len(segments))]
        entries: list[Entry | None] = [None] * len(segments)
        for entry_seam in sorted(set(seams)):
            numbers = [number for number, s in enumerate(seams) if s == entry_seam]
            fetched, hits = self._fetch_entries([segments[n] for n in numbers], entry_seam, stats)
            for number, entry, hit in zip(numbers, fetched, hits):
                entries[number] = entry
                if not hit:  # what this segment's entry serves (all but its recomputed seam) was encoded just now
                    stats.encoded_tokens += len(segments[number]) - min(entry_seam, len(segments[number]))
        spans: list[Span] = []
        position = 0
        for segment, entry, entry_seam in zip(segments, entries, seams):
            spans.append(Span(segment, position, min(entry_seam, len(segment)), entry))
            position += len(segment)
        spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
        options = StackOptions(
            reposition_keys=mode in ("transition_rope", "hypic"),
            composition="addition" if mode == "addition" else "transition",
        )
        return run_stack(self.model, spans, options=options)

    def _prefill_prefix(self, request: Request, stats: PrefillStats):
        segments = request.segments
        keys: list[str] = []
        chain = hashlib.sha256(self.model.fingerprint.encode())
        for segment in segments:
            chain.update(hashlib.sha256(torch.tensor(segment, dtype=torch.int64).numpy().tobytes()).digest())
            keys.append(chain.copy().hexdigest())
        reused, initial = 0, None
        for number in range(len(segments), 0, -1):
            checkpoint = self._prefix_checkpoints.get(keys[number - 1])
            if checkpoint is not None:
                reused, initial = number, checkpoint
                break
        stats.prefix_reused_tokens = initial.length if initial is not None else 0
        stats.cache_hits += reused
        stats.cache_misses += len(segments) - reused
        position = stats.prefix_reused_tokens
        spans = []
        for segment in segments[reused:]:
            spans.append(Span(segment, position, len(segment)))
            position += len(segment)
        spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
        result = run_stack(self.model, spans, initial=initial, want_checkpoints=True)
        for key, checkpoint in zip(keys[reused:], result.checkpoints[:-1]):
            self._prefix_checkpoints.put(key, _detach_checkpoint(checkpoint))
        return result

    # ------------------------------------------------------------------ decode

    def decode_step(self, state: DecodeState, token_id: int) -> tuple[torch.Tensor, DecodeState]:
        """Feed one token after `state`; returns next-token logits [vocab] and the new state."""
        result = run_stack(self.model, [Span([int(token_id)], state.length, 1)], initial=state)
        return result.logits, result.state

    def stream(
        self, request: Request, mode: str = "hypic", params: SamplingParams | None = None, seam_tokens: int | None = None
    ) -> Iterator[tuple[int, str]]:
        """Yield (token_id, text_delta) as tokens are chosen; the final `Generation` is the generator's return value.

        The deltas add up exactly to `Generation.text` (the decoded tokens, cut before the first stop string).
        Text that might be the start of a stop string, or ends inside a multi-byte character, is held back until
        the next token settles it (its delta is then ""); text still held when an end-of-sequence token stops
        generation comes with that token's id as the last item.
        """
        params = params or SamplingParams()
        began = time.perf_counter()
        prefill = self.prefill(request, mode, seam_tokens)
        generator = sampling_generator(params.seed)
        stop_ids = set(params.stop_token_ids) | self.model.eos_token_ids
        tokenizer = self.model.tokenizer
        generated: list[int] = []
        text, decoded, finish_reason, first_token_at = "", "", "length", None
        logits, state = prefill.logits, prefill.state
        for step in range(params.max_new_tokens):
            token = _choose_token(logits, params, generator)
            if first_token_at is None:
                first_token_at = time.perf_counter() - began
            if token in stop_ids:
                finish_reason = "stop"
                if len(decoded) > len(text):  # text held back for a stop string that never came
                    delta = decoded[len(text) :]
                    text += delta
                    yield token, delta
                break
            generated.append(token)
            decoded = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
            hit = _first_stop(decoded, params.stop_strings)
            if hit is not None:
                delta = decoded[len(text) : hit]  # text was held back from where a stop string may start
                text += delta
                if delta:
                    yield token, delta
                finish_reason = "stop"
                break
            last = step + 1 == params.max_new_tokens
            ready = len(decoded) if last else _settled_length(decoded, len(text), params.stop_strings)
            delta = decoded[len(text) : ready]
            text += delta
            yield token, delta
            if not last:
                logits, state = self.decode_step(state, token)
        total = time.perf_counter() - began
        return Generation(
            token_ids=generated,
            text=text,
            finish_reason=finish_reason,
            prefill=prefill.stats,
            time_to_first_token=first_token_at if first_token_at is not None else total,
            total_seconds=total,
            timings={
                "cache_load": prefill.stats.load_seconds,
                "encode": prefill.stats.encode_seconds,
                "compose": prefill.stats.compose_seconds,
                "prefill": prefill.stats.prefill_seconds,
                "time_to_first_token": first_token_at if first_token_at is not None else total,
                "total": total,
            },
        )

    def generate(
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        on_token: Callable[[int, str], None] | None = None,
    ) -> Generation:
        """Prefill then decode until a stop token, a stop string or `max_new_tokens`."""
        callback = None if on_token is None else (lambda item: on_token(*item))
        return drain(self.stream(request, mode, params, seam_tokens), callback)


def _detach_checkpoint(state: DecodeState) -> DecodeState:
    """Own copies of a checkpoint (slices of larger K/V tensors would otherwise keep them alive)."""
    copy = DecodeState(length=state.length)
    for index, item in state.linear.items():
        copy.linear[index] = type(item)(item.recurrent.clone(), item.conv_tail.clone())
    for index, item in state.attention.items():
        copy.attention[index] = type(item)(item.keys.clone(), item.values.clone())
    return copy


def sampling_generator(seed: int | None) -> torch.Generator:
    """The CPU generator of one generation: seeded (reproducible) or, without a seed, seeded from the operating
    system's entropy so that every unseeded generation draws fresh randomness."""
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sampling_probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Next-token probabilities [vocab] (float64) of `logits` [vocab] at `temperature` > 0 under nucleus `top_p`.

    Logits are shifted so the largest is exactly 0 before scaling, and the top ones stay 0 whatever the
    temperature: a temperature so small that every other logit scales to -inf leaves the top token(s) alone,
    so no inf - inf or 0 / 0 can make a NaN and sampling is greedy (up to exact ties). The top token always
    stays in the nucleus, which is renormalised.
    """
    shifted = logits.detach().to("cpu", torch.float64)
    shifted = shifted - shifted.max()
    scaled = torch.where(shifted == 0, torch.zeros_like(shifted), shifted / temperature)
    probabilities = torch.softmax(scaled, dim=-1)
    if top_p < 1:
        sorted_probabilities, order = torch.sort(probabilities, descending=True)
        keep = sorted_probabilities.cumsum(-1) - sorted_probabilities < top_p
        keep[0] = True
        kept = sorted_probabilities * keep
        probabilities = torch.zeros_like(probabilities).scatter(0, order, kept / kept.sum())
    return probabilities


def _choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probabilities = sampling_probabilities(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probabilities, 1, generator=generator))


def _settled_length(text: str, emitted: int, stop_strings: tuple[str, ...]) -> int:
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


def _first_stop(text: str, stop_strings: tuple[str, ...]) -> int | None:
    positions = [text.find(stop) for stop in stop_strings if stop and stop in text]
    return min(positions) if positions else None
