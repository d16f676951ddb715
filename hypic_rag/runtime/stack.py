"""One pass of the layer stack over a plan of spans: only the recomputed tokens get hidden states.

A request is laid out as contiguous spans. A span's first `recompute` tokens go through the stack with the true
context; the rest come from the span's cached entry. Each layer is a `Block` (its family's norms, residuals and
MLP); the block asks for its mixers' outputs and this module runs them over the plan, for any family:
- recurrent mixer: the running state h walks the spans in order; recomputed tokens run the recurrence from h
  (their conv sees the running conv tail), then the cached remainder applies its affine map h <- P h + Z (or
  h + Z in `addition`; the product is the transition kind's), and the conv tail takes the cached tail;
- attention mixer: queries of recomputed tokens attend causally to every position; keys/values are fresh for
  recomputed tokens and the cached keys, re-positioned at their true positions by the mixer's `Positioner` (or
  left at their standalone positions when `reposition_keys` is off; a no-op for NoPE), for the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from hypic_rag.entry import SEAM_TOKENS, Entry, tensor_name
from hypic_rag.kernels import triton_enabled
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.blocks import BlockContext
from hypic_rag.runtime.mixers.base import (
    AttentionMixer,
    Mixer,
    Projections,
    RecurrenceInputs,
    RecurrentMixer,
    TransitionRun,
)
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.segment_state import apply_in_order
from hypic_rag.runtime.state import AttentionLayerState, DecodeState, LinearLayerState
from hypic_rag.runtime.threads import serial_section


@dataclass(slots=True)
class Span:
    """token_ids [L] at sequence positions start..start+L-1; the first `recompute` tokens are recomputed.

    entry: the span's cached entry, whose suffix pair must start at `recompute` (its `seam_tokens`); None when the
    whole span is recomputed.
    """

    token_ids: list[int]
    start: int
    recompute: int
    entry: Entry | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.recompute <= len(self.token_ids):
            raise ValueError(f"recompute={self.recompute} outside 0..{len(self.token_ids)}")
        if self.entry is None and self.recompute != len(self.token_ids):
            raise ValueError("a span without a cached entry must be recomputed whole")

    @property
    def length(self) -> int:
        return len(self.token_ids)


AttentionObserver = Callable[[int, AttentionMixer, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""observe(layer_index, mixer, query [Hq, R, D], keys [Hkv, N, D], query_index [R], key_index [N]): what an
attention layer's core attends, queries and keys positioned (a probe's hook, e.g. the question's attention over
cached chunks in `evals/recompute_policies.py`)."""


@dataclass(slots=True)
class StackOptions:
    """reposition_keys: rotate cached keys at their true positions (False: keep standalone positions).
    composition: "transition" applies P h + Z per cached span; "addition" applies h + Z (the naive baseline).
    observe_attention: called by every attention layer before its core (`AttentionObserver`); None: no call."""

    reposition_keys: bool = True
    composition: Literal["transition", "addition"] = "transition"
    observe_attention: AttentionObserver | None = None

    def __post_init__(self) -> None:
        if self.composition not in ("transition", "addition"):
            raise ValueError(f"unknown composition {self.composition!r}")


@dataclass(slots=True)
class StackResult:
    """logits: [vocab] of the last recomputed token; all_logits: [R, vocab] when asked;
    checkpoints: decode states at each span end when asked; compose_seconds: time spent composing cached state."""

    logits: torch.Tensor
    state: DecodeState
    recomputed_tokens: int
    all_logits: torch.Tensor | None = None
    checkpoints: list[DecodeState] = field(default_factory=list)
    compose_seconds: float = 0.0


def _apply_cached_linear(
    state: torch.Tensor, cached: list[tuple[Entry, int]], layer_index: int, composition: str, kind: str
) -> torch.Tensor:
    """Advance the recurrent state [*state_shape] over consecutive spans' cached remainders, in order; `cached`
    holds each span's (entry, recomputed tokens). Matrix transitions on CUDA (`hypic_rag.kernels.triton_enabled`)
    go through one Triton launch for all of them, reading P/Z in their storage dtype and accumulating in float32;
    everything else folds in torch (`segment_state.apply_in_order`)."""
    for entry, recompute in cached:
        if int(entry[SEAM_TOKENS]) != recompute:
            raise ValueError(f"entry was encoded with seam {int(entry[SEAM_TOKENS])}, span recomputes {recompute}")
    states = [entry[tensor_name(layer_index, "suffix_state")] for entry, _ in cached]
    transitions = None if composition == "addition" else [entry[tensor_name(layer_index, "transition")] for entry, _ in cached]
    if kind == "matrix" and state.dim() == 3 and triton_enabled(state):
        from hypic_rag.kernels.compose import compose_affine

        return compose_affine(state, None if transitions is None else torch.stack(transitions), torch.stack(states))
    return apply_in_order(state, transitions, states, kind)


def _apply_pending(
    state: torch.Tensor, pending: list[tuple[Entry, int]], layer_index: int, composition: str, kind: str = "matrix"
) -> tuple[torch.Tensor, float]:
    """`_apply_cached_linear` over `pending` (then emptied); returns the new state and the seconds it took."""
    began = time.perf_counter()
    state = _apply_cached_linear(state, pending, layer_index, composition, kind)
    pending.clear()
    return state, time.perf_counter() - began


_rotate_into = L.rotate_into
"""Cached pre-RoPE keys rotated into the K buffer (`layers.rotate_into`; the batched pass imports it by this name)."""


def _merge_recomputed_spans(spans: list[Span]) -> list[Span]:
    """Neighbouring spans recomputed whole run as one span (one delta-rule call instead of one per span); exact,
    since nothing cached sits between them. Only when no per-span checkpoints are wanted."""
    merged: list[Span] = []
    for span in spans:
        if merged and span.entry is None and merged[-1].entry is None:
            last = merged[-1]
            merged[-1] = Span(last.token_ids + span.token_ids, last.start, last.recompute + span.recompute)
        else:
            merged.append(span)
    return merged


def _advance_tail_cached(tail: torch.Tensor, cached_tail: torch.Tensor, suffix_length: int) -> torch.Tensor:
    """Conv tail after a cached suffix of `suffix_length` tokens whose own last inputs are `cached_tail`."""
    width = tail.shape[-1]
    if width == 0 or suffix_length == 0:
        return tail
    if suffix_length >= width:
        return cached_tail.float().clone()
    return torch.cat([tail, cached_tail.float()[:, -suffix_length:]], dim=1)[:, -width:].contiguous()


@dataclass(slots=True)
class _Plan:
    """The recomputed tokens of one stack pass: spans, offsets[i] = (first row, count) of span i's recomputed
    tokens in the [R, ...] token tensors, their positions query_index [R], key_index [N] (all positions) and the
    options; `tables` caches each positioner's tables for key_index."""

    spans: list[Span]
    offsets: list[tuple[int, int]]
    query_index: torch.Tensor
    key_index: torch.Tensor
    start: int
    options: StackOptions
    want_checkpoints: bool
    dtype: torch.dtype
    token_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    tables: dict[int, object] = field(default_factory=dict)
    packed_rows: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def total_length(self) -> int:
        return int(self.key_index.shape[0])


@torch.no_grad()
def run_stack(
    model: HybridModel,
    spans: list[Span],
    initial: DecodeState | None = None,
    options: StackOptions | None = None,
    *,
    want_checkpoints: bool = False,
    want_all_logits: bool = False,
) -> StackResult:
    """Run the stack over `spans` (contiguous, starting at `initial.length` or 0) and return the next-token logits."""
    options = options or StackOptions()
    device = model.device
    if not want_checkpoints:
        spans = _merge_recomputed_spans(spans)
    start = initial.length if initial is not None else 0
    position = start
    for span in spans:
        if span.start != position:
            raise ValueError(f"spans must be contiguous: expected a span at {position}, got {span.start}")
        position += span.length
    total_length = position

    recomputed_ids: list[int] = []
    recomputed_positions: list[int] = []
    offsets: list[tuple[int, int]] = []
    for span in spans:
        offsets.append((len(recomputed_ids), span.recompute))
        recomputed_ids.extend(span.token_ids[: span.recompute])
        recomputed_positions.extend(range(span.start, span.start + span.recompute))
    if not recomputed_ids:
        raise ValueError("nothing to recompute: the last span (the question) must have recomputed tokens")
    plan = _Plan(
        token_ids=torch.tensor(recomputed_ids, dtype=torch.long, device=device),
        spans=spans,
        offsets=offsets,
        query_index=torch.tensor(recomputed_positions, dtype=torch.long, device=device),
        key_index=torch.arange(total_length, device=device),
        start=start,
        options=options,
        want_checkpoints=want_checkpoints,
        dtype=model.dtype,
    )

    with serial_section(len(recomputed_ids), device):  # few rows: small ops on one thread (`runtime/threads.py`)
        return _run_layers(model, plan, initial, want_all_logits)


def _run_layers(model: HybridModel, plan: _Plan, initial: DecodeState | None, want_all_logits: bool) -> StackResult:
    """`run_stack`'s pass through every layer and the logits, for a built plan."""
    spans, start, total_length = plan.spans, plan.start, plan.total_length
    want_checkpoints = plan.want_checkpoints
    ids = plan.token_ids
    hidden = model.embed(ids)  # [R, hidden]
    context = BlockContext(embeddings=hidden)
    new_state = DecodeState(length=total_length)
    span_linear_states: list[dict[int, LinearLayerState]] = [dict() for _ in spans]
    compose_seconds = 0.0

    last_block = len(model.blocks) - 1
    for layer_index, block in enumerate(model.blocks):
        if layer_index == last_block and not want_all_logits:
            context.output_rows = slice(-1, None)  # the last block's MLP for the last token only

        def mix(mixer: Mixer, x: torch.Tensor, layer_index: int = layer_index) -> torch.Tensor:
            nonlocal compose_seconds
            if isinstance(mixer, RecurrentMixer):
                previous = initial.linear.get(layer_index) if initial is not None else None
                mixed, final_state, per_span, seconds = _recurrent_mixer(mixer, layer_index, x, plan, previous)
                new_state.linear[layer_index] = final_state
                for span_number, span_state in enumerate(per_span):
                    span_linear_states[span_number][layer_index] = span_state
            else:
                previous_kv = initial.attention.get(layer_index) if initial is not None else None
                mixed, kv, seconds = _attention_mixer(mixer, layer_index, x, plan, previous_kv)
                new_state.attention[layer_index] = kv
            compose_seconds += seconds
            return mixed

        hidden = block.forward(hidden, mix, context)

    checkpoints: list[DecodeState] = []
    if want_checkpoints:
        end = start
        for span, linear_states in zip(spans, span_linear_states):
            end += span.length
            checkpoint = DecodeState(length=end, linear=linear_states)
            for layer_index, attention_state in new_state.attention.items():
                checkpoint.attention[layer_index] = AttentionLayerState(
                    attention_state.keys[:, :end], attention_state.values[:, :end]
                )
            checkpoints.append(checkpoint)
    all_logits = model.logits(hidden) if want_all_logits else None
    logits = all_logits[-1] if all_logits is not None else model.logits(hidden[-1:])[0]
    return StackResult(
        logits=logits,
        state=new_state,
        recomputed_tokens=int(ids.shape[0]),
        all_logits=all_logits,
        checkpoints=checkpoints,
        compose_seconds=compose_seconds,
    )


def _attention_mixer(
    mixer: AttentionMixer, layer_index: int, x: torch.Tensor, plan: _Plan, previous: AttentionLayerState | None
) -> tuple[torch.Tensor, AttentionLayerState, float]:
    """One attention mixer over the recomputed tokens x [R, hidden]: K/V buffers indexed by position (the prefix
    state, fresh and cached tokens go straight to their place), causal attention by sequence index.
    Returns (mixed [R, hidden], the layer's K/V state, seconds spent placing cached keys/values)."""
    seconds = 0.0
    positions = mixer.positions
    tables = plan.tables.get(id(positions))
    if tables is None and id(positions) not in plan.tables:
        tables = plan.tables[id(positions)] = positions.tables(plan.key_index, x)
    projections = mixer.project(x)
    query = positions.apply(projections.query, tables, plan.query_index)
    key = positions.apply(projections.key, tables, plan.query_index)
    value = projections.value
    total_length, start = plan.total_length, plan.start
    all_keys = key.new_empty(key.shape[0], total_length, key.shape[2])
    all_values = value.new_empty(value.shape[0], total_length, value.shape[2])
    if previous is not None:
        all_keys[:, :start] = previous.keys
        all_values[:, :start] = previous.values
    for span, (offset, count) in zip(plan.spans, plan.offsets):
        if count:
            all_keys[:, span.start : span.start + count] = key[:, offset : offset + count]
            all_values[:, span.start : span.start + count] = value[:, offset : offset + count]
        if span.entry is not None and count < span.length:
            began = time.perf_counter()
            at = span.start + count
            all_values[:, at : span.start + span.length] = span.entry[tensor_name(layer_index, "value")][:, count:]
            position = at if plan.options.reposition_keys else count
            positions.place(all_keys, at, span.entry[tensor_name(layer_index, "key")][:, count:], tables, position)
            seconds += time.perf_counter() - began
    if plan.options.observe_attention is not None:
        plan.options.observe_attention(layer_index, mixer, query, all_keys, plan.query_index, plan.key_index)
    core = L.attention_core(mixer, query, all_keys, all_values, plan.query_index, plan.key_index)
    return mixer.output(core, projections), AttentionLayerState(all_keys, all_values), seconds


def _gather_runs(values: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows (offset, count) of values [R, ...] as [n, longest, ...], each run zero-padded at its end."""
    longest = max(count for _, count in windows)
    out = values.new_zeros(len(windows), longest, *values.shape[1:])
    for row, (offset, count) in enumerate(windows):
        out[row, :count] = values[offset : offset + count]
    return out


def _recurrent_mixer(
    mixer: RecurrentMixer, layer_index: int, x: torch.Tensor, plan: _Plan, previous: LinearLayerState | None
) -> tuple[torch.Tensor, LinearLayerState, list[LinearLayerState], float]:
    """One recurrent mixer over the recomputed tokens x [R, hidden] laid out by the plan's spans.

    Projections run once for all recomputed tokens; each run's conv sees the running conv tail. When the plan
    has cached spans, every recomputed run but the last (the question) is evaluated in ONE batched call that also
    yields its affine map (identity-start trick); a scan over the runs' and cached spans' maps then gives every
    run's start state, and its outputs follow from the zero-start ones (`outputs_from_start`). The last run starts
    from the scanned state directly. A mixer without a recurrent state runs every run in one call.
    Returns (mixed [R, hidden], end state, per-span states if asked, compose seconds).
    """
    device = x.device
    spans, offsets, options, kind = plan.spans, plan.offsets, plan.options, mixer.transition_kind
    compose_seconds = 0.0
    projections = mixer.project(x)
    tail = previous.conv_tail.float() if previous is not None else mixer.empty_conv_tail(device)
    run_numbers: list[int] = []
    contexts: list[torch.Tensor] = []
    tails_after: list[torch.Tensor] = []
    width = tail.shape[-1]
    for span_number, (span, (offset, count)) in enumerate(zip(spans, offsets)):
        cached_after = span.length - count if span.entry is not None else 0  # the cached remainder's length
        if count:
            run_numbers.append(span_number)
            contexts.append(tail)
            if cached_after < width or width == 0:  # else the cached remainder's own tail replaces it whole
                tail = L.advance_conv_tail(tail, projections.preconv[offset : offset + count])
        if cached_after:
            tail = _advance_tail_cached(tail, span.entry[tensor_name(layer_index, "conv_tail")], cached_after)
        tails_after.append(tail)

    windows = [offsets[n] for n in run_numbers]
    lengths = [count for _, count in windows]
    recurrent = previous.recurrent.float() if previous is not None else mixer.zero_state(device)
    if kind is not None and len(run_numbers) > 1 and mixer.scans_runs and not plan.want_checkpoints:
        return _scan_runs(mixer, layer_index, plan, projections, contexts, run_numbers, recurrent, tail)

    # conv + recurrence inputs of every recomputed run in one batched call (runs zero-padded at the end)
    if windows == [(0, x.shape[0])]:  # one run of every token (full, prefix, decode): views, no copy
        gathered = projections.map(lambda tensor: tensor[None])
    else:
        gathered = projections.map(lambda tensor: _gather_runs(tensor, windows))
    convolved = mixer.convolve(gathered.preconv, torch.stack(contexts))
    inputs = mixer.recurrence_inputs(convolved, gathered, lengths)
    row_of = {number: row for row, number in enumerate(run_numbers)}
    core: torch.Tensor | None = None

    def write(offset: int, count: int, outputs: torch.Tensor) -> None:
        """core[offset : offset + count] = outputs [>= count, *output_shape] (core made on first use)."""
        nonlocal core
        if core is None:
            core = outputs.new_empty(x.shape[0], *outputs.shape[1:])
        core[offset : offset + count] = outputs[:count]

    if kind is None:  # no recurrent state: every run is independent
        outputs, _ = mixer.run(inputs, None)
        for number in run_numbers:
            offset, count = offsets[number]
            write(offset, count, outputs[row_of[number]])
        empty = mixer.zero_state(device)
        per_span = [LinearLayerState(empty, tails_after[n]) for n in range(len(spans))] if plan.want_checkpoints else []
        return mixer.output(core, projections, plan.dtype), LinearLayerState(empty, tail), per_span, 0.0

    batched_numbers = run_numbers[:-1] if len(run_numbers) > 1 and any(s.entry is not None for s in spans) else []
    batched: TransitionRun | None = None
    if batched_numbers:
        width = max(lengths[: len(batched_numbers)])
        batched = mixer.run_with_transition(inputs.select(slice(0, len(batched_numbers)), 0, width))

    per_span: list[LinearLayerState] = []
    pending: list[tuple[Entry, int]] = []  # cached remainders not yet applied: one call per run
    for span_number, (span, (offset, count)) in enumerate(zip(spans, offsets)):
        if pending and count:
            recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition, kind)
            compose_seconds += seconds
        if count:
            row = row_of[span_number]
            if batched is not None and row < len(batched_numbers):
                run = batched.select(slice(row, row + 1))
                outputs = mixer.outputs_from_start(run.zero_outputs, run.transition_outputs, recurrent[None])
                write(offset, count, outputs[0])
                recurrent = run.segment.apply(recurrent[None])[0]
            else:
                outputs, final = mixer.run(inputs.select(slice(row, row + 1), 0, count), recurrent[None])
                write(offset, count, outputs[0])
                recurrent = final[0]
        if span.entry is not None and count < span.length:
            pending.append((span.entry, count))
            if plan.want_checkpoints:
                recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition, kind)
                compose_seconds += seconds
        if plan.want_checkpoints:
            per_span.append(LinearLayerState(recurrent, tails_after[span_number]))
    if pending:
        recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition, kind)
        compose_seconds += seconds
    mixed = mixer.output(core, projections, plan.dtype)
    return mixed, LinearLayerState(recurrent, tail), per_span, compose_seconds


def _packed_rows(windows: list[tuple[int, int]], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the runs' rows go when packed end to end with each run after the first preceded by its `width` context
    rows: (the packed rows of the R tokens [R], the packed rows of the contexts [(n - 1) * width] or None)."""
    token_rows: list[int] = []
    context_rows: list[int] = []
    row = 0
    for number, (_, count) in enumerate(windows):
        if number and width:
            context_rows.extend(range(row, row + width))
            row += width
        token_rows.extend(range(row, row + count))
        row += count
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(token_rows), (as_tensor(context_rows) if context_rows else None)


def _pack_conv_inputs(
    preconv: torch.Tensor, contexts: list[torch.Tensor], rows: tuple[torch.Tensor, torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv inputs of runs packed end to end: run r's rows (offset, count) of preconv [R, C] (the runs in order,
    contiguous: rows 0..R-1), each run after the first preceded by its own left context contexts[r] [C, w] as w
    extra rows, so ONE causal conv over the packed rows gives every run's outputs with its own context. `rows`:
    `_packed_rows` of the runs (the same in every layer of a pass, so the caller keeps them).
    Returns (packed [P, C], the packed rows of the R tokens [R])."""
    token_rows, context_rows = rows
    if context_rows is None:
        return preconv, token_rows
    packed = preconv.new_empty(token_rows.shape[0] + context_rows.shape[0], preconv.shape[-1])
    packed.index_copy_(0, token_rows, preconv)
    packed.index_copy_(0, context_rows, torch.stack(contexts[1:]).transpose(1, 2).reshape(-1, preconv.shape[-1]).to(preconv.dtype))
    return packed, token_rows


def _scan_runs(
    mixer: RecurrentMixer,
    layer_index: int,
    plan: _Plan,
    projections: Projections,
    contexts: list[torch.Tensor],
    run_numbers: list[int],
    recurrent: torch.Tensor,
    tail: torch.Tensor,
) -> tuple[torch.Tensor, LinearLayerState, list[LinearLayerState], float]:
    """`_recurrent_mixer` through the mixer's `run_packed`: the recomputed runs packed end to end (one conv with
    each run's context in between, no padding), then one scan over them in order, the cached remainders between
    runs applied to the state as the scan reaches each run (no identity-start widening)."""
    spans, offsets, options, kind = plan.spans, plan.offsets, plan.options, mixer.transition_kind or "matrix"
    windows = [offsets[number] for number in run_numbers]
    before: list[list[tuple[Entry, int]]] = []  # per run: the cached remainders between it and the previous run
    pending: list[tuple[Entry, int]] = []
    for span, (_, count) in zip(spans, offsets):
        if count:
            before.append(pending)
            pending = []
        if span.entry is not None and count < span.length:
            pending.append((span.entry, count))
    compose_seconds = 0.0

    def before_run(run: int, state: torch.Tensor) -> torch.Tensor:
        nonlocal compose_seconds
        if not before[run]:
            return state
        state, seconds = _apply_pending(state, before[run], layer_index, options.composition, kind)
        compose_seconds += seconds
        return state

    # the recomputed tokens are the runs in order: offsets are contiguous, so the projections need no gathering
    width = contexts[0].shape[-1]
    rows = plan.packed_rows.get(width)
    if rows is None:
        rows = plan.packed_rows[width] = _packed_rows(windows, width, projections.preconv.device)
    packed, keep = _pack_conv_inputs(projections.preconv, contexts, rows)
    convolved = mixer.convolve(packed[None], contexts[0][None])
    if packed.shape[0] != keep.shape[0]:
        convolved = convolved[:, keep]
    inputs = mixer.recurrence_inputs(convolved, projections.map(lambda tensor: tensor[None]))
    outputs, recurrent = mixer.run_packed(inputs, [count for _, count in windows], recurrent, before_run)
    if pending:
        recurrent, seconds = _apply_pending(recurrent, pending, layer_index, options.composition, kind)
        compose_seconds += seconds
    return mixer.output(outputs[0], projections, plan.dtype), LinearLayerState(recurrent, tail), [], compose_seconds
