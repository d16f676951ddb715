"""The engine: plan a request's prefill under one of six modes, run generations a batched step at a time.

Modes (the comparison ladder of docs/design.md, all through the same stack pass; their table is `modes.MODE_TABLE`):
- full: recompute every token.
- prefix: exact reuse of the longest chunk-prefix whose boundary state was checkpointed; the rest recomputed
  (and checkpointed at each chunk boundary for later requests).
- addition: sum of zero-start states (no P), keys left at their standalone positions: the naive baseline.
- transition: P composition, keys left at their standalone positions.
- transition_rope: P composition, cached keys re-positioned with RoPE.
- hypic: transition_rope plus a recomputed seam window of `seam_tokens` at the start of every chunk; a recompute
  policy (`recompute_policy.py`; the engine's `recompute_policy` unless the request's assembly names one) may
  instead recompute some chunks whole, use another seam, or read anchored entries (`anchoring.py`).
The prefix sits at position 0 with a zero start, so its (seam-0) entry is exact in every mode; without a prefix the
first chunk's seam is recomputed from the zero start, which is exact too.

How a request is assembled (mode, seam window, policy) is one `Assembly` (`assembly.py`), resolved against the
engine's defaults into the request's `PrefillPlan`, which carries it to the stack. Entries come from the engine's
`SegmentEntries` (`get_or_encode.py`: the one get-or-encode home, over a `SegmentSource`: a persistent
`SegmentCache` or, by default, an in-process `MemorySegmentSource`).

The generation loop is `step`: one batched stack pass for a list of `Generating` sequences (a prefill item for each
one not yet prefilled, a decode item for each running one), each then choosing its next token
(`GenerationProgress`). The scheduler (`hypic_rag.runtime.scheduler`) calls it for many sequences per step; `stream` and
`generate` call it for one.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.entry.schema import Entry, check_seam_tokens, entry_tensor_bytes
from hypic_rag.entry.compression import decompress_entries
from hypic_rag.runtime.anchoring import EntryKey, anchor_of, anchored_key, chained_anchor, chunk_view
from hypic_rag.utils.lru import ByteBudgetLRU
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.encode import DEFAULT_ENCODE_BATCH_TOKENS, encode_segment
from hypic_rag.runtime.generation import Generation, GenerationProgress, GenerationStream, PrefillStats
from hypic_rag.runtime.get_or_encode import Check, MissEncoder, SegmentEntries
from hypic_rag.runtime.layout import Span, StackItem
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.recompute_policy import SEAM_POLICY, WHOLE, RecomputePlan, RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.segment_source import MemorySegmentSource, SegmentSource
from hypic_rag.runtime.stack import StackItemResult, run_batch
from hypic_rag.runtime.state import DecodeState

__all__ = [
    "Assembly", "Check", "Engine", "Generating", "MissEncoder", "PrefillPlan", "PrefillResult", "PrefillStats",
]

PIECE_TOKENS = 8
"""Shortest piece a chunk recomputed whole among cached chunks is run as (the widest seam if wider)."""

AssemblyLike = Assembly | str | None
"""An `Assembly`, a mode name (the engine's seam and policy), or None (`hypic`)."""


@dataclass(slots=True)
class PrefillResult:
    """logits: [vocab] float32 next-token logits; state: the decode state after the prompt."""

    logits: torch.Tensor
    state: DecodeState
    stats: PrefillStats


@dataclass(slots=True)
class PrefillPlan:
    """One planned prefill (`Engine.plan_prefill`): the request, its resolved `assembly` (mode, seam window,
    policy: what reaches the stack), the spans the stack runs (entries in place), the start state (a prefix-mode
    checkpoint, else None) and whether span-end checkpoints are wanted (prefix mode keeps them under
    `checkpoint_keys`, one per recomputed segment). `stats` has the lookups so far; `began` is when planning started
    (the prefill's time counts from there)."""

    request: Request
    assembly: Assembly
    spans: list[Span] = field(default_factory=list)
    initial: DecodeState | None = None
    want_checkpoints: bool = False
    checkpoint_keys: list[str] = field(default_factory=list)
    stats: PrefillStats = field(default_factory=lambda: PrefillStats(mode=""))
    began: float = 0.0

    @property
    def mode(self) -> str:
        return self.assembly.mode

    @property
    def recomputed_tokens(self) -> int:
        """Tokens the stack runs for this prefill."""
        return sum(span.recompute for span in self.spans)

    def item(self, reserve: int = 0) -> StackItem:
        """The plan as one item of a stack pass (`reserve`: room for the tokens it will decode)."""
        return StackItem(self.spans, self.initial, self.assembly, self.want_checkpoints, reserve)


@dataclass(eq=False, slots=True)
class Generating:
    """One generation in flight, as the step function advances it: its prefill plan until the prefill has run,
    then its running state (advanced in place by each decode step) and its token loop (`GenerationProgress`).
    `began`: when its time counts from (time to first token)."""

    params: SamplingParams
    plan: PrefillPlan | None
    began: float = field(default_factory=time.perf_counter)
    state: SequenceState | None = None
    progress: GenerationProgress | None = None
    stats: PrefillStats | None = None

    @property
    def prefilled(self) -> bool:
        return self.progress is not None

    @property
    def finished(self) -> bool:
        return self.progress is not None and self.progress.finished

    @property
    def step_tokens(self) -> int:
        """Tokens the next step runs for it: its prefill's recomputed tokens, else one decode token."""
        return 1 if self.prefilled or self.plan is None else self.plan.recomputed_tokens

    def item(self) -> StackItem:
        """What the next step runs for it: its prefill, or one decode token after its state."""
        if self.progress is None:
            assert self.plan is not None, "a generation without a plan has nothing to prefill"
            return self.plan.item(reserve=self.params.max_new_tokens)
        assert self.state is not None
        return StackItem([Span([self.progress.token_ids[-1]], self.state.length, 1)], self.state)

    def generation(self) -> Generation:
        """The `Generation` once finished (its prefill's stats and timings)."""
        assert self.progress is not None and self.stats is not None
        return self.progress.generation(self.stats)


class Engine:
    """Assembles requests for one model, and runs generations.

    seam_tokens, recompute_policy: what a request's assembly leaves open is resolved to these (the seam window of
    `hypic` chunks; a `RecomputePolicy` or its spec, None: the fixed seam).
    segment_source: where segment entries come from and are kept: a `SegmentSource` such as a
    `hypic_rag.cache.segment_cache.SegmentCache` opened with this model's namespace (persistent, shared across
    processes), or None for an in-process `MemorySegmentSource` of `memory_cache_bytes`. A source that holds
    another model's entries is refused (ValueError).
    prefix_cache_bytes: the budget of `prefix` mode's chunk-boundary checkpoints.
    encode_batch_tokens: padded tokens per encoding forward. miss_encoder: where cache misses are encoded (None:
    here, in batches); settable later (`engine.miss_encoder`).
    """

    def __init__(
        self, model: HybridModel, *, seam_tokens: int = 8, segment_source: SegmentSource | None = None,
        memory_cache_bytes: int = 1 << 30, prefix_cache_bytes: int = 1 << 30,
        encode_batch_tokens: int = DEFAULT_ENCODE_BATCH_TOKENS, miss_encoder: MissEncoder | None = None,
        recompute_policy: RecomputePolicy | str | None = None,
    ) -> None:
        self.model = model
        self.seam_tokens = check_seam_tokens(seam_tokens)
        self.recompute_policy: RecomputePolicy = as_policy(recompute_policy) or SEAM_POLICY
        source = segment_source if segment_source is not None else MemorySegmentSource(memory_cache_bytes)
        self.entries = SegmentEntries(model, source, batch_tokens=encode_batch_tokens, miss_encoder=miss_encoder)
        """The get-or-encode home of this engine's segment entries."""
        self._prefix_checkpoints: ByteBudgetLRU[DecodeState] = ByteBudgetLRU(prefix_cache_bytes, DecodeState.nbytes)

    # ------------------------------------------------------------------ parts
    @property
    def segment_source(self) -> SegmentSource:
        return self.entries.source

    @segment_source.setter
    def segment_source(self, source: SegmentSource) -> None:
        source.check_model(self.model.fingerprint, self.model.tokenizer_fingerprint)
        self.entries.source = source

    @property
    def miss_encoder(self) -> MissEncoder | None:
        return self.entries.miss_encoder

    @miss_encoder.setter
    def miss_encoder(self, encoder: MissEncoder | None) -> None:
        self.entries.miss_encoder = encoder

    @property
    def encode_batch_tokens(self) -> int:
        """Padded tokens per encoding forward (`SegmentEntries.batch_tokens`)."""
        return self.entries.batch_tokens

    @encode_batch_tokens.setter
    def encode_batch_tokens(self, tokens: int) -> None:
        if tokens < 1:
            raise ValueError(f"encode_batch_tokens must be positive, got {tokens}")
        self.entries.batch_tokens = tokens

    def assembly(self, mode: AssemblyLike = None, *, seam_tokens: int | None = None,
                 policy: RecomputePolicy | str | None = None) -> Assembly:
        """`mode` (an `Assembly`, a mode name, None: `hypic`) with the seam window and policy it leaves open
        set: `seam_tokens` / `policy` when given, else the engine's."""
        chosen = Assembly.of(mode)
        if seam_tokens is not None or policy is not None:
            chosen = Assembly(chosen.mode, seam_tokens if seam_tokens is not None else chosen.seam_tokens,
                              policy if policy is not None else chosen.policy)
        return chosen.resolved(self.seam_tokens, self.recompute_policy)

    # ------------------------------------------------------------------ entries
    def encode_segment(self, token_ids: list[int], seam_tokens: int | None = None) -> Entry:
        """Encode one segment standalone (positions 0..L-1); a plain dict of CPU tensors."""
        return encode_segment(self.model, list(token_ids), self.seam_tokens if seam_tokens is None else seam_tokens)

    def encode_segments(
        self, segments: list[list[int]], seam_tokens: int | None = None, *, check: Check | None = None
    ) -> list[Entry]:
        """Encode the segments in bounded batches (`SegmentEntries.encode`); nothing is kept."""
        return self.entries.encode(segments, self.seam_tokens if seam_tokens is None else seam_tokens, check=check)

    def decoded(self, entries: Sequence[Mapping[str, torch.Tensor]]) -> list[Entry]:
        """Entries as the stack composes them, on the model's device: a source's stored forms (a compressed cache
        format, `hypic_rag.entry`) moved there and decoded there, once per hit, all of them together:
        state in float32, K/V in the model's dtype. An entry already so is returned as it is."""
        return decompress_entries(entries, self.model.device, self.model.dtype)

    def fetch_entries(
        self, segments: list[list[int]], seam_tokens: int, stats: PrefillStats, *, check: Check | None = None
    ) -> list[Entry]:
        """Entries for `segments`: from the segment source on a hit, encoded (and kept) on a miss."""
        found = self.entries.get_or_encode(segments, seam_tokens, check=check)
        _count_lookup(stats, found)
        return found.entries

    # ------------------------------------------------------------------ prefill
    def plan(self, request: Request, mode: AssemblyLike = None, *, seam_tokens: int | None = None,
             policy: RecomputePolicy | str | None = None) -> RecomputePlan:
        """What `hypic` recomputes of `request`'s chunks under the assembly's policy, chunks not recomputed whole at
        the policy's seam (the assembly's, unless the policy names one); a seam at least as long as its chunk is
        planned as `WHOLE` (`RecomputePlan.normalised`)."""
        chosen = self.assembly(mode, seam_tokens=seam_tokens, policy=policy)
        lengths = [len(chunk) for chunk in request.chunk_ids]
        return chosen.policy.plan(lengths, chosen.seam_tokens, request.chunk_ranks).normalised(lengths)

    def prefill(
        self, request: Request, mode: AssemblyLike = "hypic", *, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None, check: Check | None = None,
    ) -> PrefillResult:
        """Assemble `request` (`assembly`: an `Assembly` or a mode name, with `seam_tokens` / `policy` overriding
        it) through one stack pass; returns next-token logits and the decode state. check: runs before each segment
        the prefill has to encode (raising stops it there)."""
        plan = self.plan_prefill(request, mode, seam_tokens=seam_tokens, policy=policy, check=check)
        [result] = run_batch(self.model, [plan.item()])
        prefill = self.finish_prefill(plan, result)
        return PrefillResult(prefill.logits, result.state.to_decode_state(), prefill.stats)

    def plan_prefill(
        self, request: Request, mode: AssemblyLike = "hypic", *, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None, check: Check | None = None,
        provided: Mapping[EntryKey, Entry] | None = None,
    ) -> PrefillPlan:
        """What the prefill of `request` runs through the stack: its spans (entries fetched, or encoded and kept,
        now), assembly and start state. A stack pass runs it (`plan.item()`); `finish_prefill` ends it.

        provided: entries already encoded for this request, by (entry seam, token ids): used as they are and counted
        as misses whose tokens were encoded (the scheduler encodes a batch's cold segments together)."""
        chosen = self.assembly(mode, seam_tokens=seam_tokens, policy=policy)
        plan = PrefillPlan(request, chosen, began=time.perf_counter(),
                           stats=PrefillStats(mode=chosen.mode, prompt_tokens=request.prompt_tokens,
                                              segment_reused_tokens=[0] * len(request.segments),
                                              segment_recomputed_tokens=[0] * len(request.segments)))
        if chosen.mode == "full":
            plan.spans = [Span(request.all_ids(), 0, request.prompt_tokens)]
            plan.stats.segment_recomputed_tokens = [len(segment) for segment in request.segments]
        elif chosen.mode == "prefix":
            self._plan_prefix(plan)
        else:
            seams = self.segment_seams(request, chosen)
            self._plan_composed(plan, seams, self.segment_entry_keys(request, chosen, seams=seams), check, provided or {})
        return plan

    def finish_prefill(self, plan: PrefillPlan, result: StackItemResult) -> PrefillResult:
        """The `PrefillResult` of a planned prefill once the stack ran it (prefix mode keeps its checkpoints); its
        state is the pass's `SequenceState` seen as a `DecodeState` (views)."""
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
        return PrefillResult(result.logits, result.state.to_decode_state(), stats)

    def segment_seams(self, request: Request, mode: AssemblyLike = "hypic") -> list[int | None]:
        """The entry seam of each of `request`'s segments under `assembly`: the entry a composing prefill reads for
        it, or `WHOLE` for a chunk recomputed whole (no entry). Modes that read no entries get their plain
        `ModeSpec.segment_seams` (unused)."""
        chosen = self.assembly(mode)
        spec = chosen.spec
        # the prefix always sits at position 0: its seam-0 entry is exact (Z is its state). In hypic every chunk
        # recomputes its seam (the first one, when there is no prefix, from the zero start: exact as well), or is
        # recomputed whole when the policy's plan says so (WHOLE: no entry read).
        segments = request.segments
        seams: list[int | None] = list(
            spec.segment_seams(chosen.seam_tokens, has_prefix=bool(request.prefix_ids), segments=len(segments))
        )
        if spec.seam_repair:
            first_chunk = 1 if request.prefix_ids else 0
            seams[first_chunk:] = self.plan(request, chosen).chunk_seams
        return seams

    def segment_entry_keys(
        self, request: Request, mode: AssemblyLike = "hypic", *, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None, seams: list[int | None] | None = None,
    ) -> list[EntryKey | None]:
        """Where the entry each of `request`'s segments reads under the assembly is kept: (entry seam, the encoded
        segment's token ids), None for a chunk recomputed whole. The segment and its seam (`segment_seams`, or
        `seams` when given) unless the `hypic` policy is anchored: then a chunk's entry is that of the prompt
        prefix's anchor followed by the chunk (`anchoring.anchored_key`); under a chained policy a chunk that
        follows its document's previous chunk (`Request.chunk_follows`) reads the entry of the anchor, that chunk
        and itself (`anchoring.chained_anchor`)."""
        chosen = self.assembly(mode, seam_tokens=seam_tokens, policy=policy)
        if seams is None:
            seams = self.segment_seams(request, chosen)
        anchored = chosen.spec.seam_repair and bool(getattr(chosen.policy, "anchored", False))  # a plan-like rule: no
        chained = anchored and bool(getattr(chosen.policy, "chained", False))
        anchor = anchor_of(request.prefix_ids) if anchored else []
        first_chunk = 1 if request.prefix_ids else 0
        keys: list[EntryKey | None] = []
        for number, (segment, entry_seam) in enumerate(zip(request.segments, seams)):
            chunk_number = number - first_chunk
            if entry_seam is WHOLE:
                keys.append(None)
            elif chained and chunk_number > 0 and request.chunk_follows and request.chunk_follows[chunk_number]:
                keys.append(anchored_key(chained_anchor(anchor, request.chunk_ids[chunk_number - 1]), segment,
                                         entry_seam))
            elif anchor and number >= first_chunk:
                keys.append(anchored_key(anchor, segment, entry_seam))
            else:
                keys.append((entry_seam, tuple(segment)))
        return keys

    def _plan_composed(
        self, plan: PrefillPlan, seams: list[int | None], keys: list[EntryKey | None], check: Check | None,
        provided: Mapping[EntryKey, Entry],
    ) -> None:
        request, stats = plan.request, plan.stats
        segments = request.segments
        entries: list[Entry | None] = [None] * len(segments)
        for number, key in enumerate(keys):
            if key is None:
                continue
            entry = provided.get(key)
            if entry is not None:  # encoded for this request by its caller (and kept by it): a miss whose tokens were encoded
                entries[number] = self.decoded([entry])[0]
                stats.cache_misses += 1
                stats.cache_bytes_loaded += entry_tensor_bytes(entry)
                stats.encoded_tokens += len(key[1]) - min(key[0], len(key[1]))
        for entry_seam in sorted({key[0] for key in keys if key is not None}):
            numbers = [n for n, key in enumerate(keys) if key is not None and key[0] == entry_seam and entries[n] is None]
            if not numbers:
                continue
            stored = [list(keys[n][1]) for n in numbers]  # type: ignore[index]
            found = self.entries.get_or_encode(stored, entry_seam, check=check)
            _count_lookup(stats, found)
            for number, ids, entry, hit in zip(numbers, stored, found.entries, found.hits):
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
        # recomputed run but the last of a request from the identity start in calls padded to their length class,
        # so one 256-token run beside 8-token seams would cost (runs x 256) tokens of delta rule. Pieces are exact
        # (consecutive recomputed spans carry the state and conv tail); the stack merges neighbouring recomputed
        # spans back unless asked for per-span checkpoints, hence `want_checkpoints` below.
        piece = max([s for s in seams if s is not WHOLE] + [PIECE_TOKENS])
        chunk_seams = seams[1:] if request.prefix_ids else seams
        split = WHOLE in chunk_seams and any(s is not WHOLE and s > 0 for s in chunk_seams)
        for number, (segment, entry, entry_seam) in enumerate(zip(segments, entries, seams)):
            recomputed = len(segment) if entry_seam is WHOLE else min(entry_seam, len(segment))
            stats.segment_recomputed_tokens[number] = recomputed
            if entry_seam is WHOLE and split:
                for begin in range(0, len(segment), piece):
                    part = segment[begin : begin + piece]
                    plan.spans.append(Span(part, position + begin, len(part)))
            else:
                plan.spans.append(Span(segment, position, recomputed, entry))
            position += len(segment)
        plan.spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
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
        for number in range(reused, len(segments)):
            stats.segment_recomputed_tokens[number] = len(segments[number])
        for segment in segments[reused:]:
            plan.spans.append(Span(segment, position, len(segment)))
            position += len(segment)
        plan.spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
        plan.initial = initial
        plan.want_checkpoints = True
        plan.checkpoint_keys = keys[reused:]

    # ------------------------------------------------------------------ the generation loop
    def decode_step(self, state: DecodeState | SequenceState, token_id: int) -> tuple[torch.Tensor, DecodeState]:
        """Feed one token after `state` (a `DecodeState` is read, never written; a `SequenceState` is advanced in
        place); returns next-token logits [vocab] and the new state."""
        [result] = run_batch(self.model, [StackItem([Span([int(token_id)], state.length, 1)], state)])
        return result.logits, result.state.to_decode_state()

    def start(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None, *,
        check: Check | None = None, began: float | None = None,
    ) -> Generating:
        """A generation of `request`, its prefill planned now (its entries fetched, or encoded and kept; `check`
        before each segment it encodes), ready for `step`."""
        began = time.perf_counter() if began is None else began
        plan = self.plan_prefill(request, mode, check=check)
        plan.began = began
        return Generating(params or SamplingParams(), plan, began)

    def step(self, generations: list[Generating]) -> list[StackItemResult]:
        """ONE batched stack pass for `generations` (each's `item()`: its prefill, or one decode token after its
        state), in order; each then takes its result (`take`). The one step function of every generation."""
        return run_batch(self.model, [generation.item() for generation in generations])

    def take(self, generation: Generating, result: StackItemResult) -> tuple[int, str] | None:
        """Hand `result` (its share of a `step`) to `generation`: a prefill ends (it starts decoding), its next token
        is chosen; returns the (token_id, text_delta) to stream, if any (`GenerationProgress.advance`)."""
        if generation.progress is None:
            assert generation.plan is not None
            generation.stats = self.finish_prefill(generation.plan, result).stats
            answer_lead = generation.plan.request.answer_lead
            generation.plan = None
            generation.progress = GenerationProgress(
                generation.params, self.model.eos_token_ids, self.model.tokenizer, generation.began, answer_lead
            )
        generation.state = result.state
        return generation.progress.advance(result.logits)

    def stream(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None, *,
        seam_tokens: int | None = None, policy: RecomputePolicy | str | None = None, check: Check | None = None,
    ) -> GenerationStream:
        """A `GenerationStream` of (token_id, text_delta) as tokens are chosen; its `.result` is the `Generation`:
        the step function (`step`) with this one sequence.

        Nothing runs until the stream is iterated. The deltas add up exactly to `Generation.text` (the decoded
        tokens, cut before the first stop string). Text that might be the start of a stop string, or ends inside a
        multi-byte character, is held back until the next token settles it (its delta is then ""); text still
        held when an end-of-sequence token stops generation comes with that token's id as the last item.
        check: runs before every step and before each segment the prefill encodes (a deadline, a cancellation);
        what it raises stops the generation there. assembly / seam_tokens / policy: as in `prefill`.
        """
        chosen = self.assembly(mode, seam_tokens=seam_tokens, policy=policy)
        return GenerationStream(self._steps_alone(request, chosen, params, check), check=check)

    def _steps_alone(
        self, request: Request, assembly: Assembly, params: SamplingParams | None, check: Check | None
    ) -> Generator[tuple[int, str], None, Generation]:
        generation = self.start(request, assembly, params, check=check)
        while not generation.finished:
            [result] = self.step([generation])
            item = self.take(generation, result)
            if item is not None:
                yield item
        return generation.generation()

    def generate(
        self, request: Request, mode: AssemblyLike = "hypic", params: SamplingParams | None = None,
        on_token: Callable[[int, str], None] | None = None, *, seam_tokens: int | None = None,
        policy: RecomputePolicy | str | None = None, check: Check | None = None,
    ) -> Generation:
        """Prefill then decode until a stop token, a stop string or `max_new_tokens` (`stream` run to its end)."""
        callback = None if on_token is None else (lambda item: on_token(*item))
        return self.stream(request, mode, params, seam_tokens=seam_tokens, policy=policy, check=check).run(callback)


def _count_lookup(stats: PrefillStats, found: Any) -> None:
    """Add a get-or-encode lookup (`FoundEntries`) to a prefill's stats."""
    hits = sum(found.hits)
    stats.cache_hits += hits
    stats.cache_misses += len(found.hits) - hits
    stats.cache_bytes_loaded += found.tensor_bytes
    stats.encode_seconds += found.encode_seconds
    stats.load_seconds += found.seconds - found.encode_seconds


def _detach_checkpoint(state: DecodeState) -> DecodeState:
    """Own copies of a checkpoint (slices of larger K/V tensors would otherwise keep them alive)."""
    copy = DecodeState(length=state.length)
    for index, item in state.linear.items():
        copy.linear[index] = type(item)(item.recurrent.clone(), item.conv_tail.clone())
    for index, item in state.attention.items():
        copy.attention[index] = type(item)(item.keys.clone(), item.values.clone())
    return copy

