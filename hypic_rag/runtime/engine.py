"""The engine: fetch or encode segment entries, assemble a request under one of six modes, generate.

Modes (the comparison ladder of docs/design.md, all through the same stack pass; their table is `modes.MODE_TABLE`):
- full: recompute every token.
- prefix: exact reuse of the longest chunk-prefix whose boundary state was checkpointed; the rest recomputed
  (and checkpointed at each chunk boundary for later requests).
- addition: sum of zero-start states (no P), keys left at their standalone positions: the naive baseline.
- transition: P composition, keys left at their standalone positions.
- transition_rope: P composition, cached keys re-positioned with RoPE.
- hypic: transition_rope plus a recomputed seam window of `seam_tokens` at the start of every chunk; a recompute
  policy (`recompute_policy.py`; the engine's `recompute_policy` unless a call names one) may instead recompute
  some chunks whole, use another seam, or read anchored entries (`anchoring.py`).
The prefix sits at position 0 with a zero start, so its (seam-0) entry is exact in every mode; without a prefix the
first chunk's seam is recomputed from the zero start, which is exact too.

Entries come from a `SegmentSource` (`segment_source.py`): a persistent `SegmentCache` or, by default, an
in-process `MemorySegmentSource`. Sampling is `sampling.py`; the stream a generation returns is `generation.py`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hypic_rag.entry import Entry, check_seam_tokens, entry_tensor_bytes
from hypic_rag.runtime.anchoring import EntryKey, anchor_of, anchored_key, chunk_view
from hypic_rag.lru import ByteBudgetLRU
from hypic_rag.runtime.encode import DEFAULT_ENCODE_BATCH_TOKENS, encode_segment, encode_segments, plan_encode_batches
from hypic_rag.runtime.generation import Generation, GenerationProgress, GenerationStream
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import ModeSpec, mode_spec
from hypic_rag.runtime.recompute_policy import SEAM_POLICY, WHOLE, RecomputePlan, RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.segment_source import MemorySegmentSource, SegmentSource
from hypic_rag.runtime.stack import Span, StackOptions, run_stack
from hypic_rag.runtime.state import DecodeState

logger = logging.getLogger(__name__)

PIECE_TOKENS = 8
"""Shortest piece a chunk recomputed whole among cached chunks is run as (the widest seam if wider)."""

Check = Callable[[], None]
"""A per-step check (deadline, cancellation): returns to go on, raises to stop."""


class MissEncoder(Protocol):
    """Encodes a request's cache misses somewhere else, in parallel (segment parallelism, docs/design.md): e.g.
    `hypic_rag.distributed.ray_encoder.RayEncoderPool`, which runs the batches `plan_encode_batches` makes, longest
    first, on Ray actors. It must return what `Engine.encode_segments` would, in the order of `segments`."""

    def encode_segments(self, segments: list[list[int]], seam_tokens: int, check: Check | None = None) -> list[Entry]: ...


@dataclass(slots=True)
class PrefillStats:
    """Token accounting and timings (seconds) of one prefill.

    prompt_tokens = cached_tokens + encoded_tokens + recomputed_tokens + prefix_reused_tokens, where
    cached_tokens come from segment entries that existed before this prefill (cache hits), encoded_tokens from
    entries this prefill had to encode (cache misses), recomputed_tokens ran through the model in the assembly
    pass (seams, question, full/prefix mode) and prefix_reused_tokens came from a prefix-mode checkpoint.
    segment_reused_tokens: per segment of the request (`Request.segments`), its tokens taken from an entry held
    before this prefill or from a prefix checkpoint (0 for a segment encoded now, and in `full` mode).
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

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class PrefillResult:
    """logits: [vocab] float32 next-token logits; state: the decode state after the prompt."""

    logits: torch.Tensor
    state: DecodeState
    stats: PrefillStats


@dataclass(slots=True)
class PrefillPlan:
    """One planned prefill (`Engine.plan_prefill`): the spans the stack runs (entries in place), its options, the
    start state (a prefix-mode checkpoint, else None) and whether span-end checkpoints are wanted (prefix mode keeps
    them under `checkpoint_keys`, one per recomputed segment). `stats` has the lookups so far; `began` is when
    planning started (the prefill's time counts from there)."""

    request: Request
    mode: str
    spans: list[Span]
    options: StackOptions
    initial: DecodeState | None = None
    want_checkpoints: bool = False
    checkpoint_keys: list[str] = field(default_factory=list)
    stats: PrefillStats = field(default_factory=lambda: PrefillStats(mode=""))
    began: float = 0.0

    @property
    def recomputed_tokens(self) -> int:
        """Tokens the stack runs for this prefill."""
        return sum(span.recompute for span in self.spans)


class StackOutcome(Protocol):
    """What `finish_prefill` reads of a stack pass over a plan (`StackResult`, or one item of a batched pass)."""

    logits: torch.Tensor
    state: Any
    recomputed_tokens: int
    checkpoints: list[DecodeState]
    compose_seconds: float


class Engine:
    """Assembles requests for one model.

    segment_source: where segment entries come from and are kept: a `SegmentSource` such as a
    `hypic_rag.cache.segment_cache.SegmentCache` opened with this model's namespace (persistent, shared across
    processes), or None for an in-process `MemorySegmentSource` of `memory_cache_bytes`. A source that holds
    another model's entries is refused (ValueError).
    prefix_cache_bytes: the budget of `prefix` mode's chunk-boundary checkpoints.
    miss_encoder: where cache misses are encoded (None: here, in batches); settable later (`engine.miss_encoder`).
    recompute_policy: what `hypic` recomputes when a call names no policy (a `RecomputePolicy` or its spec; None:
    the fixed seam of `seam_tokens`).
    """

    def __init__(
        self,
        model: HybridModel,
        *,
        seam_tokens: int = 8,
        segment_source: SegmentSource | None = None,
        memory_cache_bytes: int = 1 << 30,
        prefix_cache_bytes: int = 1 << 30,
        encode_batch_tokens: int = DEFAULT_ENCODE_BATCH_TOKENS,
        miss_encoder: MissEncoder | None = None,
        recompute_policy: RecomputePolicy | str | None = None,
    ) -> None:
        if encode_batch_tokens < 1:
            raise ValueError(f"encode_batch_tokens must be positive, got {encode_batch_tokens}")
        self.model = model
        self.encode_batch_tokens = encode_batch_tokens
        self.miss_encoder = miss_encoder
        self.seam_tokens = check_seam_tokens(seam_tokens)
        self.recompute_policy: RecomputePolicy = as_policy(recompute_policy) or SEAM_POLICY
        self.segment_source: SegmentSource = (
            segment_source if segment_source is not None else MemorySegmentSource(memory_cache_bytes)
        )
        self.segment_source.check_model(model.fingerprint, model.tokenizer_fingerprint)
        self._prefix_checkpoints: ByteBudgetLRU[DecodeState] = ByteBudgetLRU(prefix_cache_bytes, DecodeState.nbytes)

    # ------------------------------------------------------------------ entries

    def encode_segment(self, token_ids: list[int], seam_tokens: int | None = None) -> Entry:
        """Encode one segment standalone (positions 0..L-1); a plain dict of CPU tensors."""
        return encode_segment(self.model, list(token_ids), self.seam_tokens if seam_tokens is None else seam_tokens)

    def encode_segments(
        self, segments: list[list[int]], seam_tokens: int | None = None, *, check: Check | None = None
    ) -> list[Entry]:
        """Encode the segments, several per forward (batches of similar lengths up to `encode_batch_tokens` padded
        tokens; `encode_segments` in encode.py). `check` runs before each batch (raising stops there: none of the
        segments is kept). Entries come back in the order of `segments`. With a `miss_encoder` the batches run there
        (on several encoders at once), with the same bytes."""
        seam = self.seam_tokens if seam_tokens is None else seam_tokens
        if self.miss_encoder is not None and segments:
            return self.miss_encoder.encode_segments([list(segment) for segment in segments], seam, check)
        entries: list[Entry | None] = [None] * len(segments)
        for batch in plan_encode_batches([len(segment) for segment in segments], self.encode_batch_tokens):
            if check is not None:
                check()
            for index, entry in zip(batch, encode_segments(self.model, [list(segments[i]) for i in batch], seam)):
                entries[index] = entry
        return entries  # type: ignore[return-value]

    def fetch_entries(
        self, segments: list[list[int]], seam_tokens: int, stats: PrefillStats, *, check: Check | None = None
    ) -> list[Entry]:
        """Entries for `segments`: from the segment source on a hit, encoded (and kept) on a miss."""
        return self._fetch_entries(segments, seam_tokens, stats, check)[0]

    def _fetch_entries(
        self, segments: list[list[int]], seam_tokens: int, stats: PrefillStats, check: Check | None = None
    ) -> tuple[list[Entry], list[bool]]:
        """(entries, hit per segment): a segment the source does not hold is encoded and kept."""
        began = time.perf_counter()
        encode_seconds = 0.0

        def encode_many(missing: list[list[int]]) -> list[Entry]:
            nonlocal encode_seconds
            start = time.perf_counter()
            entries = self.encode_segments(missing, seam_tokens, check=check)
            encode_seconds += time.perf_counter() - start
            return entries

        entries, hits = self.segment_source.get_or_encode_segments(segments, seam_tokens, encode_many)
        hits = [bool(hit) for hit in hits]
        hit_count = sum(hits)
        device = self.model.device
        stats.cache_bytes_loaded += sum(entry_tensor_bytes(entry) for entry in entries)
        entries = [
            e if all(tensor.device == device for tensor in e.values())
            else {name: tensor.to(device, non_blocking=True) for name, tensor in e.items()}
            for e in entries
        ]
        stats.cache_hits += hit_count
        stats.cache_misses += len(segments) - hit_count
        stats.encode_seconds += encode_seconds
        stats.load_seconds += time.perf_counter() - began - encode_seconds
        return entries, hits

    # ------------------------------------------------------------------ prefill

    def plan(
        self, request: Request, seam_tokens: int | None = None, policy: RecomputePolicy | str | None = None
    ) -> RecomputePlan:
        """What `hypic` recomputes of `request`'s chunks under `policy` (the engine's when None), chunks not
        recomputed whole at the policy's seam (`seam_tokens`, else the engine's, unless the policy names one)."""
        chosen = as_policy(policy) or self.recompute_policy
        seam = check_seam_tokens(self.seam_tokens if seam_tokens is None else seam_tokens)
        return chosen.plan([len(chunk) for chunk in request.chunk_ids], seam, request.chunk_ranks)

    def prefill(
        self,
        request: Request,
        mode: str = "hypic",
        seam_tokens: int | None = None,
        *,
        check: Check | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> PrefillResult:
        """Assemble `request` under `mode`; returns next-token logits and the decode state.

        check: runs before each segment the prefill has to encode (raising stops it there). policy: in `hypic`,
        which chunks are recomputed whole and the seam of the others (`recompute_policy.py`; None: the engine's
        `recompute_policy`); the other modes ignore it."""
        plan = self.plan_prefill(request, mode, seam_tokens, check=check, policy=policy)
        result = run_stack(self.model, plan.spans, initial=plan.initial, options=plan.options,
                           want_checkpoints=plan.want_checkpoints)
        return self.finish_prefill(plan, result)

    def plan_prefill(
        self,
        request: Request,
        mode: str = "hypic",
        seam_tokens: int | None = None,
        *,
        check: Check | None = None,
        policy: RecomputePolicy | str | None = None,
        provided: Mapping[EntryKey, Entry] | None = None,
    ) -> PrefillPlan:
        """What the prefill of `request` under `mode` runs through the stack: its spans (entries fetched, or encoded
        and kept, now), options and start state. `run_stack` (or a batched pass) runs it; `finish_prefill` ends it.

        policy: the recompute policy of a `hypic` prefill (`prefill`; None: the engine's). provided: entries already
        encoded for this request, by (entry seam, token ids): used as they are and counted as misses whose tokens
        were encoded (the scheduler encodes a batch's cold segments together)."""
        spec = mode_spec(mode)
        seam = check_seam_tokens(self.seam_tokens if seam_tokens is None else seam_tokens)
        plan = PrefillPlan(request, mode, [], StackOptions(), began=time.perf_counter(),
                           stats=PrefillStats(mode=mode, prompt_tokens=request.prompt_tokens,
                                              segment_reused_tokens=[0] * len(request.segments)))
        if mode == "full":
            plan.spans = [Span(request.all_ids(), 0, request.prompt_tokens)]
        elif mode == "prefix":
            self._plan_prefix(plan)
        else:
            seams = self.segment_seams(request, mode, seam, policy)
            keys = self.segment_entry_keys(request, mode, seam, policy, seams=seams)
            self._plan_composed(plan, spec, seams, keys, check, provided or {})
        return plan

    def finish_prefill(self, plan: PrefillPlan, result: StackOutcome) -> PrefillResult:
        """The `PrefillResult` of a planned prefill once the stack ran it (prefix mode keeps its checkpoints)."""
        stats = plan.stats
        for key, checkpoint in zip(plan.checkpoint_keys, result.checkpoints[:-1]):
            self._prefix_checkpoints.put(key, _detach_checkpoint(checkpoint))
        stats.recomputed_tokens = result.recomputed_tokens
        stats.cached_tokens = (
            plan.request.prompt_tokens - result.recomputed_tokens - stats.prefix_reused_tokens - stats.encoded_tokens
        )
        stats.compose_seconds = result.compose_seconds
        stats.total_seconds = time.perf_counter() - plan.began
        stats.prefill_seconds = stats.total_seconds - stats.load_seconds - stats.encode_seconds - stats.compose_seconds
        return PrefillResult(result.logits, result.state, stats)

    def segment_seams(
        self, request: Request, mode: str = "hypic", seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> list[int | None]:
        """The entry seam of each of `request`'s segments under `mode` (and, in `hypic`, `policy`; None: the
        engine's): the entry a composing prefill reads for it, or `WHOLE` for a chunk recomputed whole (no entry).
        Modes that read no entries get their plain `ModeSpec.segment_seams` (unused)."""
        spec = mode_spec(mode)
        seam = check_seam_tokens(self.seam_tokens if seam_tokens is None else seam_tokens)
        # the prefix always sits at position 0: its seam-0 entry is exact (Z is its state). In hypic every chunk
        # recomputes its seam (the first one, when there is no prefix, from the zero start: exact as well), or is
        # recomputed whole when the policy's plan says so (WHOLE: no entry read).
        segments = request.segments
        seams: list[int | None] = list(spec.segment_seams(seam, has_prefix=bool(request.prefix_ids), segments=len(segments)))
        if spec.seam_repair:
            first_chunk = 1 if request.prefix_ids else 0
            seams[first_chunk:] = self.plan(request, seam, policy).chunk_seams
        return seams

    def segment_entry_keys(
        self, request: Request, mode: str = "hypic", seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None, *, seams: list[int | None] | None = None,
    ) -> list[EntryKey | None]:
        """Where the entry each of `request`'s segments reads under `mode` (and `policy`) is kept: (entry seam, the
        encoded segment's token ids), None for a chunk recomputed whole. The segment and its seam
        (`segment_seams`, or `seams` when given) unless the `hypic` policy is anchored: then a chunk's entry is that
        of the prompt prefix's anchor followed by the chunk (`anchoring.anchored_key`)."""
        if seams is None:
            seams = self.segment_seams(request, mode, seam_tokens, policy)
        chosen = as_policy(policy) or self.recompute_policy
        anchored = mode_spec(mode).seam_repair and bool(getattr(chosen, "anchored", False))
        anchor = anchor_of(request.prefix_ids) if anchored else []
        first_chunk = 1 if request.prefix_ids else 0
        keys: list[EntryKey | None] = []
        for number, (segment, entry_seam) in enumerate(zip(request.segments, seams)):
            if entry_seam is WHOLE:
                keys.append(None)
            elif anchor and number >= first_chunk:
                keys.append(anchored_key(anchor, segment, entry_seam))
            else:
                keys.append((entry_seam, tuple(segment)))
        return keys

    def _plan_composed(
        self, plan: PrefillPlan, spec: ModeSpec, seams: list[int | None], keys: list[EntryKey | None],
        check: Check | None, provided: Mapping[EntryKey, Entry],
    ) -> None:
        request, stats = plan.request, plan.stats
        segments = request.segments
        entries: list[Entry | None] = [None] * len(segments)
        for number, key in enumerate(keys):
            if key is None:
                continue
            entry = provided.get(key)
            if entry is not None:  # encoded for this request by its caller: a miss whose tokens were encoded
                entries[number] = {name: tensor.to(self.model.device) for name, tensor in entry.items()}
                stats.cache_misses += 1
                stats.cache_bytes_loaded += entry_tensor_bytes(entry)
                stats.encoded_tokens += len(key[1]) - min(key[0], len(key[1]))
        for entry_seam in sorted({key[0] for key in keys if key is not None}):
            numbers = [n for n, key in enumerate(keys) if key is not None and key[0] == entry_seam and entries[n] is None]
            if not numbers:
                continue
            stored = [list(keys[n][1]) for n in numbers]  # type: ignore[index]
            fetched, hits = self._fetch_entries(stored, entry_seam, stats, check)
            for number, ids, entry, hit in zip(numbers, stored, fetched, hits):
                entries[number] = entry
                if hit:
                    stats.segment_reused_tokens[number] = len(ids) - min(entry_seam, len(ids))
                else:  # what this segment's entry serves (all but its recomputed seam) was encoded just now
                    stats.encoded_tokens += len(ids) - min(entry_seam, len(ids))
        for number, (key, entry_seam) in enumerate(zip(keys, seams)):
            entry = entries[number]
            if key is not None and entry is not None and entry_seam is not WHOLE and key[0] != entry_seam:
                entries[number] = chunk_view(entry, key[0] - entry_seam, entry_seam)  # anchored: the chunk's rows
        if check is not None:  # the entries are in (and kept); a request past its deadline stops before assembly
            check()
        position = 0
        # a chunk recomputed whole among cached ones runs as pieces of the seam's width: the stack evaluates every
        # recomputed run but the last in one batch padded to the longest run, so one 256-token run beside 8-token
        # seams would cost (runs x 256) tokens of delta rule. Pieces are exact (consecutive recomputed spans carry
        # the state and conv tail); the stack merges neighbouring recomputed spans back unless asked for
        # per-span checkpoints, hence `want_checkpoints` below. To go once the stack batches runs by length.
        piece = max([s for s in seams if s is not WHOLE] + [PIECE_TOKENS])
        chunk_seams = seams[1:] if request.prefix_ids else seams
        split = WHOLE in chunk_seams and any(s is not WHOLE and s > 0 for s in chunk_seams)
        for segment, entry, entry_seam in zip(segments, entries, seams):
            if entry_seam is WHOLE and split:
                for begin in range(0, len(segment), piece):
                    part = segment[begin : begin + piece]
                    plan.spans.append(Span(part, position + begin, len(part)))
            else:
                recomputed = len(segment) if entry_seam is WHOLE else min(entry_seam, len(segment))
                plan.spans.append(Span(segment, position, recomputed, entry))
            position += len(segment)
        plan.spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
        plan.options = StackOptions(reposition_keys=spec.reposition_keys, composition=spec.composition)
        plan.want_checkpoints = split

    def _plan_prefix(self, plan: PrefillPlan) -> None:
        request, stats = plan.request, plan.stats
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
        for number in range(reused):
            stats.segment_reused_tokens[number] = len(segments[number])
        position = stats.prefix_reused_tokens
        for segment in segments[reused:]:
            plan.spans.append(Span(segment, position, len(segment)))
            position += len(segment)
        plan.spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
        plan.initial = initial
        plan.want_checkpoints = True
        plan.checkpoint_keys = keys[reused:]

    # ------------------------------------------------------------------ decode

    def decode_step(self, state: DecodeState, token_id: int) -> tuple[torch.Tensor, DecodeState]:
        """Feed one token after `state`; returns next-token logits [vocab] and the new state."""
        result = run_stack(self.model, [Span([int(token_id)], state.length, 1)], initial=state)
        return result.logits, result.state

    def stream(
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        *,
        check: Check | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> GenerationStream:
        """A `GenerationStream` of (token_id, text_delta) as tokens are chosen; its `.result` is the `Generation`.

        Nothing runs until the stream is iterated. The deltas add up exactly to `Generation.text` (the decoded
        tokens, cut before the first stop string). Text that might be the start of a stop string, or ends inside a
        multi-byte character, is held back until the next token settles it (its delta is then ""); text still
        held when an end-of-sequence token stops generation comes with that token's id as the last item.
        check: runs before every step and before each segment the prefill encodes (a deadline, a cancellation);
        what it raises stops the generation there. policy: the recompute policy of a `hypic` prefill (`prefill`).
        """
        return GenerationStream(self._generation_steps(request, mode, params, seam_tokens, check, policy), check=check)

    def _generation_steps(
        self,
        request: Request,
        mode: str,
        params: SamplingParams | None,
        seam_tokens: int | None,
        check: Check | None,
        policy: RecomputePolicy | str | None = None,
    ) -> Generator[tuple[int, str], None, Generation]:
        params = params or SamplingParams()
        began = time.perf_counter()
        prefill = self.prefill(request, mode, seam_tokens, check=check, policy=policy)
        progress = GenerationProgress(params, self.model.eos_token_ids, self.model.tokenizer, began)
        logits, state = prefill.logits, prefill.state
        while True:
            item = progress.advance(logits)
            if item is not None:
                yield item
            if progress.finished:
                break
            logits, state = self.decode_step(state, progress.token_ids[-1])
        return progress.generation(prefill.stats)

    def generate(
        self,
        request: Request,
        mode: str = "hypic",
        params: SamplingParams | None = None,
        seam_tokens: int | None = None,
        on_token: Callable[[int, str], None] | None = None,
        *,
        check: Check | None = None,
        policy: RecomputePolicy | str | None = None,
    ) -> Generation:
        """Prefill then decode until a stop token, a stop string or `max_new_tokens` (`stream` run to its end)."""
        callback = None if on_token is None else (lambda item: on_token(*item))
        return self.stream(request, mode, params, seam_tokens, check=check, policy=policy).run(callback)


def _detach_checkpoint(state: DecodeState) -> DecodeState:
    """Own copies of a checkpoint (slices of larger K/V tensors would otherwise keep them alive)."""
    copy = DecodeState(length=state.length)
    for index, item in state.linear.items():
        copy.linear[index] = type(item)(item.recurrent.clone(), item.conv_tail.clone())
    for index, item in state.attention.items():
        copy.attention[index] = type(item)(item.keys.clone(), item.values.clone())
    return copy
