"""The batched stack pass: several sequences' recomputed tokens and decode tokens in one forward.

Each `BatchItem` is what `run_stack` takes for one sequence (a plan of spans, where they start, the mode's stack
options); `run_batch` runs them all at once and gives each exactly what `run_stack` gives it alone (up to float32
round-off of matmuls over more rows: the tests check 1e-5 and identical greedy tokens). A prefill is an item whose
spans are a request's plan (`Engine.plan_prefill`, any mode); a decode step is an item of one recomputed token
after a running sequence's `SequenceState`. Per layer:
- token-wise over the flat tokens of all items at once: embedding, norms, projections (linear-attention inputs,
  q/k/v), output projections, MLPs, the LM head (the last token of each item);
- per sequence: the short conv from each item's own conv tail; the gated delta rule from its own recurrent state
  ([H, K, V]), the items' walks over their spans advancing together so that the runs of many items (seams,
  questions, decode tokens) go through one padded call from their stacked states [n, H, K, V], with each item's
  cached spans' affine maps applied to its own state between them; attention of each item's queries over its own
  keys and values (its own causal view; two small matmuls, or scaled_dot_product_attention for long prefills).
A running sequence's `SequenceState` is advanced in place: its new keys and values are written into its buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hypic_rag.entry import LINEAR_LAYER, SEAM_TOKENS, tensor_name
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_with_transition
from hypic_rag.runtime.segment_state import SegmentState
from hypic_rag.runtime.stack import (
    Span,
    StackOptions,
    StackResult,
    _advance_tail_cached,
    _merge_recomputed_spans,
    _rotate_into,
    run_stack,
)
from hypic_rag.runtime.state import AttentionLayerState, DecodeState, LinearLayerState
from hypic_rag.runtime.threads import serial_section


@dataclass(slots=True)
class BatchItem:
    """One sequence of a batched pass: `spans` (contiguous, as `run_stack` takes them) after `state`.

    state: None (the spans start at position 0), a `DecodeState` (a prefix-mode checkpoint: copied, never
    written) or a running sequence's `SequenceState` (advanced in place). reserve: room for this many more tokens
    in the attention buffers of a new state (the tokens the sequence will decode). want_checkpoints: decode states
    at each span end (prefix mode), as `run_stack` gives them.
    """

    spans: list[Span]
    state: SequenceState | DecodeState | None = None
    options: StackOptions = field(default_factory=StackOptions)
    want_checkpoints: bool = False
    reserve: int = 0


@dataclass(slots=True)
class BatchItemResult:
    """logits: [vocab] float32 after the item's last recomputed token; state: the sequence's state after its spans;
    checkpoints: decode states at each span end when asked; compose_seconds: time spent composing cached state."""

    logits: torch.Tensor
    state: SequenceState
    recomputed_tokens: int
    checkpoints: list[DecodeState] = field(default_factory=list)
    compose_seconds: float = 0.0


@dataclass(slots=True)
class _Layout:
    """Where an item's tokens are: its spans with (offset, count) of their recomputed tokens among the item's, the
    item's first row among the flat tokens, its start position and its length after the pass."""

    item: BatchItem
    spans: list[Span]
    offsets: list[tuple[int, int]]
    row: int
    start: int
    total: int
    recomputed: int
    positions: torch.Tensor  # [recomputed] sequence positions of the item's recomputed tokens
    state: SequenceState = field(default_factory=lambda: SequenceState(0))
    initial: DecodeState | SequenceState | None = None
    span_linear: list[dict[int, LinearLayerState]] = field(default_factory=list)
    compose_seconds: float = 0.0


def _lay_out(items: list[BatchItem], device: torch.device) -> tuple[list[_Layout], list[int]]:
    """Layouts of `items` and the flat list of their recomputed token ids."""
    layouts: list[_Layout] = []
    flat_ids: list[int] = []
    for item in items:
        spans = item.spans if item.want_checkpoints else _merge_recomputed_spans(item.spans)
        start = item.state.length if item.state is not None else 0
        position = start
        offsets: list[tuple[int, int]] = []
        positions: list[int] = []
        count = 0
        for span in spans:
            if span.start != position:
                raise ValueError(f"spans must be contiguous: expected a span at {position}, got {span.start}")
            offsets.append((count, span.recompute))
            flat_ids.extend(span.token_ids[: span.recompute])
            positions.extend(range(span.start, span.start + span.recompute))
            count += span.recompute
            position += span.length
        if count == 0:
            raise ValueError("nothing to recompute: the last span (the question) must have recomputed tokens")
        layouts.append(_Layout(
            item, spans, offsets, len(flat_ids) - count, start, position, count,
            torch.tensor(positions, dtype=torch.long, device=device),
            span_linear=[dict() for _ in spans], initial=item.state,
        ))
    return layouts, flat_ids


def _prepare_state(model: HybridModel, layout: _Layout, like: torch.Tensor) -> None:
    """The state the pass writes: the running sequence's own (room made), or new buffers of the item's length plus
    its reserve with the start state's keys and values copied in."""
    item = layout.item
    if isinstance(item.state, SequenceState):
        item.state.ensure_capacity(layout.total)
        layout.state = item.state
        return
    state = SequenceState(length=layout.start)
    capacity = layout.total + item.reserve
    for layer_index, layer in enumerate(model.layers):
        if model.layer_types[layer_index] == LINEAR_LAYER:
            continue
        attention = layer.self_attn
        heads = attention.config.num_key_value_heads
        for table in (state.keys, state.values):
            table[layer_index] = like.new_empty(heads, capacity, attention.head_dim)
        if item.state is not None:
            state.keys[layer_index][:, : layout.start] = item.state.attention[layer_index].keys
            state.values[layer_index][:, : layout.start] = item.state.attention[layer_index].values
    layout.state = state


def _previous_linear(layout: _Layout, layer_index: int) -> LinearLayerState | None:
    initial = layout.initial
    return initial.linear.get(layer_index) if initial is not None else None


def batch_supported(model: HybridModel) -> bool:
    """Whether `run_batch` can run `model`: the Qwen family (Qwen3.5 dense / MoE, Qwen3-Next), whose layers are
    Gated DeltaNet or gated attention with rotary positions. Other families (`runtime/families`) run their items
    one at a time through `run_each`."""
    from hypic_rag.runtime.families.qwen import QwenHybrid

    return isinstance(model.family, QwenHybrid)


def run_each(model: HybridModel, items: list[BatchItem]) -> list[StackResult]:
    """The per-request path for a family the batched pass does not cover: each item through `run_stack` on its
    own (its state a `DecodeState`, returned anew, never written in place). One result per item, in order."""
    results = []
    for item in items:
        if isinstance(item.state, SequenceState):
            raise TypeError("run_each takes DecodeState items (a SequenceState belongs to the batched pass)")
        results.append(run_stack(model, item.spans, initial=item.state, options=item.options,
                                 want_checkpoints=item.want_checkpoints))
    return results


@torch.no_grad()
def run_batch(model: HybridModel, items: list[BatchItem]) -> list[BatchItemResult]:
    """Run every item's spans through the stack in one pass; one result per item, in order (Qwen family only:
    `batch_supported`)."""
    if not items:
        return []
    if not batch_supported(model):
        raise ValueError(f"the batched pass does not cover {type(model.family).__name__} models; use run_each")
    device = model.device
    layouts, flat_ids = _lay_out(items, device)
    ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
    hidden = model.backbone.embed_tokens(ids)  # [R, hidden], R = all items' recomputed tokens
    positions = torch.cat([layout.positions for layout in layouts])
    rotary = _Rotary(model.backbone.rotary_emb, positions, hidden, layouts)
    for layout in layouts:
        _prepare_state(model, layout, hidden)
    last_rows = torch.tensor([layout.row + layout.recomputed - 1 for layout in layouts], device=device)
    trim = TRIM_LAST_LAYER and len(flat_ids) > len(layouts)
    final = len(model.layers) - 1
    with serial_section(len(flat_ids), device):  # few rows (decode steps): small ops on one thread
        for layer_index, layer in enumerate(model.layers):
            x = layer.input_layernorm(hidden)
            last_only = trim and layer_index == final  # every token's keys / state, only the last tokens' outputs
            if model.layer_types[layer_index] == LINEAR_LAYER:
                mixed = _linear_layer_batch(layer.linear_attn, layer_index, x, layouts, model.dtype)
                if last_only:
                    mixed = mixed[last_rows]
            else:
                mixed = _attention_layer_batch(layer.self_attn, layer_index, x, layouts, rotary, last_only=last_only)
            if last_only:
                hidden = hidden[last_rows]
            hidden = hidden + mixed
            hidden = hidden + L.mlp_forward(layer, layer.post_attention_layernorm(hidden))
        logits = model.logits(hidden if trim else hidden[last_rows])  # [items, vocab]
    results = []
    for number, layout in enumerate(layouts):
        layout.state.length = layout.total
        results.append(BatchItemResult(
            logits=logits[number], state=layout.state, recomputed_tokens=layout.recomputed,
            checkpoints=_checkpoints(layout) if layout.item.want_checkpoints else [],
            compose_seconds=layout.compose_seconds,
        ))
    return results


def decode_batch(model: HybridModel, states: list[SequenceState], token_ids: list[int]) -> torch.Tensor:
    """Feed one token to each running sequence (of any lengths) in one pass: logits [B, vocab] float32; each state
    is advanced in place."""
    items = [BatchItem([Span([int(token)], state.length, 1)], state) for state, token in zip(states, token_ids, strict=True)]
    return torch.stack([result.logits for result in run_batch(model, items)])


def _checkpoints(layout: _Layout) -> list[DecodeState]:
    """Decode states at each span end (keys and values are views of the sequence's buffers)."""
    checkpoints = []
    end = layout.start
    for span, linear in zip(layout.spans, layout.span_linear):
        end += span.length
        checkpoint = DecodeState(length=end, linear=linear)
        for layer_index, keys in layout.state.keys.items():
            checkpoint.attention[layer_index] = AttentionLayerState(keys[:, :end], layout.state.values[layer_index][:, :end])
        checkpoints.append(checkpoint)
    return checkpoints


# ---------------------------------------------------------------------------------------------- attention


class _Rotary:
    """cos / sin of the pass: for the recomputed tokens' positions, and for every position up to the longest item
    only when some item rotates cached keys in (a decode step needs its new positions only). The tables are an
    elementwise function of the position, so either way gives the same values."""

    def __init__(self, rotary_embedding: torch.nn.Module, positions: torch.Tensor, like: torch.Tensor,
                 layouts: list[_Layout]) -> None:
        rotates = any(span.entry is not None and span.recompute < span.length for layout in layouts for span in layout.spans)
        if rotates:
            longest = max(layout.total for layout in layouts)
            self.cos_all, self.sin_all = L.rotary_tables(rotary_embedding, torch.arange(longest, device=like.device), like)
            self.cos, self.sin = self.cos_all[positions], self.sin_all[positions]
        else:
            self.cos, self.sin = L.rotary_tables(rotary_embedding, positions, like)


TRIM_LAST_LAYER = True
"""Whether the last layer of a pass with more tokens than items computes its mixer's outputs (attention queries)
and MLP for each item's last token only (the only rows the logits read); its keys, values and recurrent states
still take every token. False: every row, as the reference the tests compare it with."""


def _attention_layer_batch(
    attention: torch.nn.Module, layer_index: int, x: torch.Tensor, layouts: list[_Layout], rotary: _Rotary,
    last_only: bool = False,
) -> torch.Tensor:
    """Projections and rotary over the flat tokens x [R, hidden]; each item's queries attend causally over its own
    keys and values (fresh ones written into its buffers, cached ones rotated in when its state is new). [R, hidden];
    last_only: only each item's last query attends, [items, hidden] (every key and value is still written)."""
    query, key, value, gate = L.attention_inputs(attention, x)  # [Hq, R, D], [Hkv, R, D]
    query = L.apply_rotary(query, rotary.cos, rotary.sin)
    key = L.apply_rotary(key, rotary.cos, rotary.sin)
    core = query.new_empty(len(layouts) if last_only else x.shape[0], query.shape[0] * query.shape[2])
    for number, layout in enumerate(layouts):
        keys, values = layout.state.keys[layer_index], layout.state.values[layer_index]
        for span, (offset, count) in zip(layout.spans, layout.offsets):
            row = layout.row + offset
            if count:
                keys[:, span.start : span.start + count] = key[:, row : row + count]
                values[:, span.start : span.start + count] = value[:, row : row + count]
            if span.entry is not None and count < span.length:
                began = time.perf_counter()
                at = span.start + count
                values[:, at : span.start + span.length] = span.entry[tensor_name(layer_index, "value")][:, count:]
                rotate_from = at if layout.item.options.reposition_keys else count
                _rotate_into(keys, at, span.entry[tensor_name(layer_index, "key")][:, count:], rotary.cos_all,
                             rotary.sin_all, rotate_from)
                layout.compose_seconds += time.perf_counter() - began
        rows = slice(layout.row, layout.row + layout.recomputed)
        keys, values = keys[:, : layout.total], values[:, : layout.total]
        if last_only:
            last = layout.row + layout.recomputed - 1
            core[number] = _grouped_attention(attention, query[:, last : last + 1], keys, values, layout.positions[-1:])[0]
        elif layout.recomputed <= SMALL_QUERY_TOKENS:  # seams + question, a decode token: two small matmuls
            core[rows] = _grouped_attention(attention, query[:, rows], keys, values, layout.positions)
        else:
            key_index = torch.arange(layout.total, device=x.device)
            core[rows] = L.attention_core(attention, query[:, rows], keys, values, layout.positions, key_index)
    if last_only and gate.numel():
        gate = gate[[layout.row + layout.recomputed - 1 for layout in layouts]]
    return L.attention_output(attention, core, gate)


SMALL_QUERY_TOKENS = 256
"""Up to this many queries per item, attention is two plain matmuls (scores [H_kv, N, G*T] fit easily); more (a
`full` or `prefix` prefill) go through `layers.attention_core` (scaled_dot_product_attention)."""


def _grouped_attention(
    attention: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries [Hq, T, D] at sequence `positions` [T] over keys / values [Hkv, N, D] at
    positions 0..N-1 (key j is seen by a query at p iff j <= p); the query heads of one kv head share its keys,
    which are read in place (no copy per query head, no transposed copy). Returns [T, Hq*D]: `layers.attention_core`
    (scaled_dot_product_attention) up to float32 round-off."""
    heads, tokens, head_dim = query.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    groups = heads // kv_heads
    grouped = query.reshape(kv_heads, groups * tokens, head_dim)  # head kv * groups + g, token t -> row g * T + t
    scores = torch.matmul(grouped, keys.to(query.dtype).transpose(1, 2)).float()  # [Hkv, G*T, N]
    if tokens > 1 or int(positions[0]) < length - 1:  # some query may not see every key
        hidden = torch.arange(length, device=keys.device)[None, :] > positions[:, None]  # [T, N]
        scores = scores.view(kv_heads, groups, tokens, length).masked_fill_(hidden, float("-inf"))
    weights = torch.softmax(scores.mul_(attention.scaling), dim=-1).to(query.dtype).view(kv_heads, groups * tokens, length)
    out = torch.matmul(weights, values.to(query.dtype))  # [Hkv, G*T, D]
    return out.reshape(heads, tokens, head_dim).transpose(0, 1).reshape(tokens, heads * head_dim)


# ---------------------------------------------------------------------------------------------- linear attention


@dataclass(slots=True)
class _Run:
    """One recomputed run: layout number, span number, first flat row, token count, conv context [C, kernel-1]."""

    layout: int
    span: int
    row: int
    count: int
    context: torch.Tensor


@dataclass(slots=True)
class _Op:
    """One step of an item's walk over its spans in a linear layer: run `run` (a recomputed run) from the state, or
    apply `entry`'s cached suffix map to it. `ends_span`: the state after it is the state at its span's end."""

    span: int
    run: int | None = None
    entry: dict[str, torch.Tensor] | None = None
    ends_span: bool = False


def _length_class(count: int) -> int:
    """Runs are padded to the next power of two of their length class (at most 2x padding per group)."""
    return 1 << max(0, (count - 1).bit_length())


def _group_runs(numbers: list[int], runs: list[_Run]) -> list[list[int]]:
    """Run numbers grouped by length class (each group is one padded call)."""
    groups: dict[int, list[int]] = {}
    for number in numbers:
        groups.setdefault(_length_class(runs[number].count), []).append(number)
    return list(groups.values())


def _linear_layer_batch(
    mixer: torch.nn.Module, layer_index: int, x: torch.Tensor, layouts: list[_Layout], dtype: torch.dtype
) -> torch.Tensor:
    """One Gated DeltaNet layer over the flat tokens x [R, hidden] of every item. Returns [R, hidden]; sets each
    item's new linear state (and per-span states when it wants checkpoints).

    Each item walks its spans as `stack._linear_layer` does for one: recomputed runs evaluated from the running
    state (their conv from the running conv tail), cached remainders applied as affine maps (P h + Z, or h + Z in
    `addition`). The walks advance together, one step of every item at a time (a wavefront): the runs of a step go
    through the gated delta rule in one padded call per length class from their stacked states [n, H, K, V] (their
    conv and inputs too), and each cached map is applied to its item's state in place. (Alone, `run_stack` evaluates a request's seams at once through
    their affine maps instead; both are exact, and agree to float32 round-off.)
    """
    device = x.device
    preconv, output_gate, b, a = L.linear_projections(mixer, x)
    if _all_decode_steps(layouts, layer_index):
        core = _linear_decode_steps(mixer, layer_index, preconv, b, a, layouts)
        return L.linear_mixer_output(mixer, core, output_gate, dtype)
    runs: list[_Run] = []
    walks: list[list[_Op]] = []
    final_tails: list[torch.Tensor] = []
    tails_after: list[list[torch.Tensor]] = []
    for number, layout in enumerate(layouts):
        previous = _previous_linear(layout, layer_index)
        tail = previous.conv_tail.float() if previous is not None else L.empty_conv_tail(mixer, device)
        walk: list[_Op] = []
        after: list[torch.Tensor] = []
        for span_number, (span, (offset, count)) in enumerate(zip(layout.spans, layout.offsets)):
            if count:
                row = layout.row + offset
                walk.append(_Op(span_number, run=len(runs)))
                runs.append(_Run(number, span_number, row, count, tail))
                tail = L.advance_conv_tail(tail, preconv[row : row + count])
            if span.entry is not None and count < span.length:
                if int(span.entry[SEAM_TOKENS]) != count:
                    raise ValueError(f"entry was encoded with seam {int(span.entry[SEAM_TOKENS])}, span recomputes {count}")
                walk.append(_Op(span_number, entry=span.entry))
                tail = _advance_tail_cached(tail, span.entry[tensor_name(layer_index, "conv_tail")], span.length - count)
            walk[-1].ends_span = True
            after.append(tail)
        walks.append(walk)
        final_tails.append(tail)
        tails_after.append(after)

    states: list[torch.Tensor] = []
    for layout in layouts:
        previous = _previous_linear(layout, layer_index)
        states.append(
            previous.recurrent.float()
            if previous is not None
            else torch.zeros(mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim, device=device)
        )
    core = torch.empty(mixer.num_v_heads, x.shape[0], mixer.head_v_dim, device=device)
    if PARALLEL_RUNS and any(sum(op.run is not None for op in walk) > 1 for walk in walks):
        _linear_runs_in_parallel(mixer, preconv, b, a, layer_index, layouts, runs, walks, tails_after, states, core)
    else:
        _linear_runs_in_waves(mixer, preconv, b, a, layer_index, layouts, runs, walks, tails_after, states, core)
    for number, layout in enumerate(layouts):
        layout.state.linear[layer_index] = LinearLayerState(states[number], final_tails[number])
    return L.linear_mixer_output(mixer, core, output_gate, dtype)


PARALLEL_RUNS = False
"""Whether a pass where some item has several recomputed runs in a Gated DeltaNet layer (a `hypic` prefill: its
seams and question) runs them all at once through their affine maps (`_linear_runs_in_parallel`) rather than step
by step (`_linear_runs_in_waves`). Off: on 2 CPU cores, 8 RAG k = 8 prefills of the 174M timing model took 4.8 s
in parallel against 3.1 s step by step (the maps' K extra state columns double the recurrence's work, which
outweighs the saved calls); both agree to float32 round-off (tests/runtime/test_batch_fast_paths.py)."""


def _linear_runs_in_waves(
    mixer: torch.nn.Module, preconv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer_index: int,
    layouts: list[_Layout], runs: list[_Run], walks: list[list[_Op]], tails_after: list[list[torch.Tensor]],
    states: list[torch.Tensor], core: torch.Tensor,
) -> None:
    """The items' walks advancing together, one step of every item at a time (a wavefront): the runs of a step go
    through the gated delta rule in one padded call per length class from their stacked states [n, H, K, V] (their
    conv and inputs too), and the cached maps of a step are applied together. Writes each run's outputs into core
    [H, R, V] and leaves each item's end state in `states`."""
    for wave in range(max(len(walk) for walk in walks)):
        steps = [(number, walk[wave]) for number, walk in enumerate(walks) if wave < len(walk)]
        run_of = {op.run: number for number, op in steps if op.run is not None}
        for group in _group_runs(list(run_of), runs):
            # conv (each run from its own tail) and delta-rule inputs of the group, padded to its longest run
            windows = [(runs[n].row, runs[n].count) for n in group]
            parts = L.batched_delta_rule_inputs(
                mixer, _gather(preconv, windows), _gather(b, windows), _gather(a, windows),
                torch.stack([runs[n].context for n in group]), [count for _, count in windows],
            )
            outputs, finals = gated_delta_rule(*parts, torch.stack([states[run_of[n]] for n in group]))
            for index, n in enumerate(group):
                run = runs[n]
                core[:, run.row : run.row + run.count] = outputs[index, :, : run.count]
                states[run_of[n]] = finals[index]
        mapped = [(number, op.entry) for number, op in steps if op.entry is not None]
        if mapped:
            began = time.perf_counter()
            _apply_cached_together(states, mapped, layer_index, layouts)
            share = (time.perf_counter() - began) / len(mapped)
            for number, _ in mapped:
                layouts[number].compose_seconds += share
        _keep_span_states(steps, layer_index, layouts, tails_after, states)


def _keep_span_states(
    steps: list[tuple[int, _Op]], layer_index: int, layouts: list[_Layout], tails_after: list[list[torch.Tensor]],
    states: list[torch.Tensor],
) -> None:
    """The states at span ends, for the items that want checkpoints."""
    for number, op in steps:
        if op.ends_span and layouts[number].item.want_checkpoints:
            layouts[number].span_linear[op.span][layer_index] = LinearLayerState(
                states[number], tails_after[number][op.span]
            )


def _linear_runs_in_parallel(
    mixer: torch.nn.Module, preconv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer_index: int,
    layouts: list[_Layout], runs: list[_Run], walks: list[list[_Op]], tails_after: list[list[torch.Tensor]],
    states: list[torch.Tensor], core: torch.Tensor,
) -> None:
    """Every recomputed run of every item at once, through affine maps: each length class of runs goes through the
    gated delta rule from the identity start in one padded call (`gated_delta_rule_with_transition`: each run's
    map S -> P S + Z, its outputs from a zero start and P_t^T q_t); then each item's walk composes its state through
    the maps of its runs and cached spans in order (the maps of a step of all walks in one batched product), keeping
    the state each run starts from; last, each run's outputs are its zero-start outputs plus (P_t^T q_t) S_start. The
    same values as `_linear_runs_in_waves` (float32 round-off), in two calls per layer rather than one per run.
    Writes core [H, R, V]; leaves each item's end state in `states`."""
    maps: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(runs)  # type: ignore[list-item]
    groups = _group_runs(list(range(len(runs))), runs)
    evaluated: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    for group in groups:
        windows = [(runs[n].row, runs[n].count) for n in group]
        parts = L.batched_delta_rule_inputs(
            mixer, _gather(preconv, windows), _gather(b, windows), _gather(a, windows),
            torch.stack([runs[n].context for n in group]), [count for _, count in windows],
        )
        zero_outputs, transition_outputs, segment = gated_delta_rule_with_transition(*parts)
        evaluated.append((group, zero_outputs, transition_outputs))  # [g, H, T, V], [g, H, T, K]
        for index, n in enumerate(group):
            maps[n] = (segment.transition[index], segment.state[index])
    starts: list[torch.Tensor] = [None] * len(runs)  # type: ignore[list-item]
    for wave in range(max(len(walk) for walk in walks)):
        steps = [(number, walk[wave]) for number, walk in enumerate(walks) if wave < len(walk)]
        affine: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        cached: list[int] = []
        for number, op in steps:
            if op.run is not None:
                starts[op.run] = states[number]
                affine.append((number, *maps[op.run]))
                continue
            assert op.entry is not None
            began = time.perf_counter()
            composition = layouts[number].item.options.composition
            transition = op.entry.get(tensor_name(layer_index, "transition")) if composition != "addition" else None
            if transition is not None and transition.dim() == 3 and transition.shape[-1] == states[number].shape[-2]:
                affine.append((number, transition, op.entry[tensor_name(layer_index, "suffix_state")]))
                cached.append(number)
            else:
                states[number] = _apply_cached(states[number], op.entry, layer_index, composition)
            layouts[number].compose_seconds += time.perf_counter() - began
        began = time.perf_counter()
        _affine_together(states, affine)
        if cached:
            share = (time.perf_counter() - began) * len(cached) / len(affine)
            for number in cached:
                layouts[number].compose_seconds += share / len(cached)
        _keep_span_states(steps, layer_index, layouts, tails_after, states)
    for group, zero_outputs, transition_outputs in evaluated:
        start = torch.stack([starts[n] for n in group])  # [g, H, K, V]
        outputs = torch.matmul(transition_outputs, start).add_(zero_outputs)  # [g, H, T, V]
        for index, n in enumerate(group):
            run = runs[n]
            core[:, run.row : run.row + run.count] = outputs[index, :, : run.count]


def _affine_together(states: list[torch.Tensor], affine: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """states[number] <- P states[number] + Z for each (number, P [H, K, K], Z [H, K, V]), in one batched product
    when there are several (new tensors, never written in place)."""
    if len(affine) == 1:
        number, transition, suffix = affine[0]
        states[number] = torch.baddbmm(suffix.float(), transition.float(), states[number].float())
    elif affine:
        start = torch.stack([states[number].float() for number, _, _ in affine])  # [n, H, K, V]
        transitions = torch.stack([transition.float() for _, transition, _ in affine])  # [n, H, K, K]
        suffixes = torch.stack([suffix.float() for _, _, suffix in affine])  # [n, H, K, V]
        ended = torch.baddbmm(suffixes.flatten(0, 1), transitions.flatten(0, 1), start.flatten(0, 1)).view_as(start)
        for index, (number, _, _) in enumerate(affine):
            states[number] = ended[index]


def _all_decode_steps(layouts: list[_Layout], layer_index: int) -> bool:
    """Whether every item is one recomputed token after a state with this layer's linear state (a decode step):
    then the layer needs no walk over spans (`_linear_decode_steps`)."""
    for layout in layouts:
        if layout.recomputed != 1 or len(layout.spans) != 1 or layout.item.want_checkpoints:
            return False
        if layout.spans[0].length != 1 or _previous_linear(layout, layer_index) is None:
            return False
    return True


def _linear_decode_steps(
    mixer: torch.nn.Module, layer_index: int, preconv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
    layouts: list[_Layout],
) -> torch.Tensor:
    """One Gated DeltaNet decode step of every item at once: item n's token is row n of preconv [n, C], b, a [n, H];
    its conv window is its conv tail [C, kernel-1] and the token (a weighted sum, no conv call), its recurrent state
    [H, K, V] steps once (`gated_delta_rule` over the stacked states [n, H, K, V]). Sets each item's new linear
    state; returns core [H, n, V]. The same values as the walk of `_linear_layer_batch` (float32 round-off)."""
    from hypic_rag.runtime.mixers.base import Projections
    from hypic_rag.runtime.mixers.gated_deltanet import GatedDeltaNetMixer

    previous = [_previous_linear(layout, layer_index) for layout in layouts]
    tails = torch.stack([state.conv_tail for state in previous]).float()  # [n, C, kernel-1]
    states = torch.stack([state.recurrent for state in previous]).float()  # [n, H, K, V]
    conv = mixer.conv1d
    weight = conv.weight[:, 0, :]  # [C, kernel]
    window = torch.cat([tails.to(weight.dtype), preconv[:, :, None].to(weight.dtype)], dim=2)  # [n, C, kernel]
    convolved = (window * weight).sum(dim=-1)
    if conv.bias is not None:
        convolved = convolved + conv.bias
    convolved = torch.nn.functional.silu(convolved)[:, None]  # [n, 1, C]
    gated = GatedDeltaNetMixer(mixer)
    inputs = gated.recurrence_inputs(convolved, Projections(preconv[:, None], (b[:, None], b[:, None], a[:, None])))
    outputs, finals = gated_delta_rule(*inputs.as_tuple(), states)  # [n, H, 1, V], [n, H, K, V]
    new_tails = torch.cat([tails, preconv[:, :, None].float()], dim=2)[:, :, 1:] if tails.shape[-1] else tails
    for number, layout in enumerate(layouts):
        layout.state.linear[layer_index] = LinearLayerState(finals[number], new_tails[number])
    return outputs[:, :, 0].transpose(0, 1)


def _apply_cached_together(
    states: list[torch.Tensor], mapped: list[tuple[int, dict[str, torch.Tensor]]], layer_index: int,
    layouts: list[_Layout],
) -> None:
    """Apply each (item number, entry)'s cached map to states[number] [H, K, V] (replaced, never written in place):
    the `transition` maps with a matrix P [H, K, K] of several items in one batched product P S + Z over their
    stacked states, the others (`addition`, one item) one at a time (`_apply_cached`). Same values."""
    together = []
    for number, entry in mapped:
        composition = layouts[number].item.options.composition
        transition = entry.get(tensor_name(layer_index, "transition")) if composition != "addition" else None
        state = states[number]
        if transition is not None and transition.dim() == state.dim() == 3 and transition.shape[-1] == state.shape[-2]:
            together.append((number, transition, entry[tensor_name(layer_index, "suffix_state")]))
        else:
            states[number] = _apply_cached(state, entry, layer_index, composition)
    _affine_together(states, together)


def _apply_cached(state: torch.Tensor, entry: dict[str, torch.Tensor], layer_index: int, composition: str) -> torch.Tensor:
    """The state [H, K, V] after a cached span: P S + Z with its suffix map (S + Z in `addition`)."""
    suffix = entry[tensor_name(layer_index, "suffix_state")]
    if composition == "addition":
        return state + suffix.float()
    return SegmentState(entry[tensor_name(layer_index, "transition")], suffix).apply(state)


def _gather(values: torch.Tensor, windows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows (offset, count) of values [R, ...] as [n, longest, ...], each run zero-padded at its end."""
    longest = max(count for _, count in windows)
    out = values.new_zeros(len(windows), longest, *values.shape[1:])
    for row, (offset, count) in enumerate(windows):
        out[row, :count] = values[offset : offset + count]
    return out
