"""The one pass of the layer stack: the recomputed tokens of one or many sequences, any family, in one forward.

A sequence's request is laid out as contiguous spans. A span's first `recompute` tokens go through the stack with
the true context; the rest come from the span's cached entry. A `StackItem` is one sequence in a pass: its spans
after its state (none, a prefix-mode checkpoint, or a running sequence's own `SequenceState`). A prefill is an item
whose spans are a request's plan (`Engine.plan_prefill`, any mode); a decode step is an item of one recomputed
token. `run_batch` runs every item at once and gives each exactly what it gets alone (float32 round-off of
products over more rows apart: the tests check 1e-5 and identical greedy tokens). Per layer, each `Block` (its
family's norms, residuals and MLP) asks for its mixers' outputs on the flat tokens of every item, [R, hidden]:
- token-wise over all items at once: embedding, norms, every mixer's projections and output path, MLPs, the LM
  head (each item's last token);
- recurrent mixer (`recurrent_pass.py`): each item walks its spans with its own running state h ([*state_shape],
  stacked [n, ...] across items) and conv tail; recomputed runs run the recurrence from h (their conv sees the
  running conv tail), cached remainders apply their affine map h <- P h + Z (or h + Z in `addition`; the product
  is the mixer's transition kind), the conv tail takes the cached tail;
- attention mixer: each item's queries attend causally over its own keys and values; keys/values are fresh for
  recomputed tokens and the cached keys, re-positioned at their true positions by the mixer's `Positioner` (or
  left at their standalone positions when the assembly does not re-position; a no-op for NoPE), for the rest.
A running sequence's `SequenceState` is advanced in place: its new keys and values are written into its buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.blocks import BlockContext
from hypic_rag.runtime.layout import AttentionObserver, Layout, Span, StackItem, lay_out
from hypic_rag.runtime.mixers.base import AttentionMixer, Mixer, Positioner, RecurrentMixer
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.recurrent_pass import recurrent_layer
from hypic_rag.runtime.state import AttentionLayerState, DecodeState
from hypic_rag.runtime.threads import serial_section, wide_for

__all__ = ["Span", "StackItem", "StackItemResult", "StackResult", "decode_batch", "run_batch", "run_stack"]


@dataclass(slots=True)
class StackItemResult:
    """logits: [vocab] float32 after the item's last recomputed token; state: the sequence's state after its spans;
    checkpoints: decode states at each span end when asked; compose_seconds: time spent composing cached state;
    all_logits: [recomputed, vocab] when the pass was asked for every row's logits."""

    logits: torch.Tensor
    state: SequenceState
    recomputed_tokens: int
    checkpoints: list[DecodeState] = field(default_factory=list)
    compose_seconds: float = 0.0
    all_logits: torch.Tensor | None = None


@dataclass(slots=True)
class StackResult:
    """`run_stack`'s result: logits [vocab] of the last recomputed token; state: the `DecodeState` after the spans
    (views of the pass's buffers); all_logits [R, vocab] when asked; checkpoints at each span end when asked."""

    logits: torch.Tensor
    state: DecodeState
    recomputed_tokens: int
    all_logits: torch.Tensor | None = None
    checkpoints: list[DecodeState] = field(default_factory=list)
    compose_seconds: float = 0.0


def _prepare_state(layout: Layout) -> None:
    """The state the pass writes: the running sequence's own (room made for its new tokens), or a new one of the
    item's length plus its reserve with a `DecodeState` start's keys and values copied in (its linear states are
    read, never written)."""
    item = layout.item
    if isinstance(item.state, SequenceState):
        item.state.ensure_capacity(layout.total)
        layout.state = item.state
    elif item.state is not None:
        layout.state = SequenceState.from_decode_state(item.state, reserve=layout.total - layout.start + item.reserve)
    else:
        layout.state = SequenceState(length=0)


@dataclass(slots=True)
class _Pass:
    """One pass's layouts and what its layers share: positioner tables by positioner, and the recurrent mixers'
    per-item walks' packed rows by conv width (`recurrent_pass`)."""

    layouts: list[Layout]
    dtype: torch.dtype
    query_positions: torch.Tensor  # [R] every recomputed token's position
    tables: dict[int, tuple[Any, torch.Tensor | slice]] = field(default_factory=dict)
    shared: dict[Any, Any] = field(default_factory=dict)

    def position_tables(self, positions: Positioner, like: torch.Tensor) -> tuple[Any, torch.Tensor | slice]:
        """(tables, index of the recomputed tokens' rows in them) for `positions`: tables over every position up to
        the longest item when some item places cached keys (they are rotated at any of them), else over the
        recomputed tokens' positions only (a decode step needs its new positions only). The tables are an
        elementwise function of the position, so either way gives the same values."""
        key = id(positions)
        found = self.tables.get(key)
        if found is None:
            if positions.moves_keys and any(layout.places_cached_keys() for layout in self.layouts):
                longest = max(layout.total for layout in self.layouts)
                tables = positions.tables(torch.arange(longest, device=like.device), like)
                found = (tables, self.query_positions)
            else:
                found = (positions.tables(self.query_positions, like), slice(None))
            self.tables[key] = found
        return found


@torch.no_grad()
def run_batch(model: HybridModel, items: list[StackItem], *, want_all_logits: bool = False) -> list[StackItemResult]:
    """Run every item's spans through the stack in one pass; one result per item, in order.

    want_all_logits: also the logits of every recomputed row (`StackItemResult.all_logits`); otherwise the last
    block works on each item's last token only (`BlockContext.output_rows`)."""
    if not items:
        return []
    device = model.device
    layouts, flat_ids = lay_out(items, device)
    for layout in layouts:
        _prepare_state(layout)
    ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
    pass_ = _Pass(layouts, model.dtype, torch.cat([layout.positions for layout in layouts]))
    last_rows = [layout.row + layout.recomputed - 1 for layout in layouts]
    trim = not want_all_logits and len(flat_ids) > len(layouts)
    # small ops on one thread when every item's own work is small (decode steps, seams and questions), however many
    # items: an item's recurrence and cached maps are as small in a batch as alone, and the large ops (linears,
    # attention, products of large states) widen by their own size (`runtime/threads.py`; docs/runtime.md)
    with serial_section(max(layout.recomputed for layout in layouts), device):
        hidden = model.embed(ids)  # [R, hidden]
        context = BlockContext(embeddings=hidden)
        last_block = len(model.blocks) - 1
        for layer_index, block in enumerate(model.blocks):
            if layer_index == last_block and trim:  # the last block's MLP for each item's last token only
                context.output_rows = (
                    slice(-1, None) if len(layouts) == 1 else torch.tensor(last_rows, dtype=torch.long, device=device)
                )

            def mix(mixer: Mixer, x: torch.Tensor, layer_index: int = layer_index) -> torch.Tensor:
                if isinstance(mixer, RecurrentMixer):
                    return recurrent_layer(mixer, layer_index, x, layouts, pass_.dtype, pass_.shared)
                return _attention_layer(mixer, layer_index, x, pass_)

            hidden = block.forward(hidden, mix, context)
        every = model.logits(hidden) if want_all_logits else None  # [R, vocab]
        if every is not None:
            logits = every[last_rows]
        else:  # rows a block kept beyond each item's last (a block that ignores `output_rows`) are dropped
            logits = model.logits(hidden if hidden.shape[0] == len(layouts) else hidden[last_rows])
    results = []
    for number, layout in enumerate(layouts):
        layout.state.length = layout.total
        results.append(StackItemResult(
            logits=logits[number], state=layout.state, recomputed_tokens=layout.recomputed,
            checkpoints=_checkpoints(layout) if layout.item.want_checkpoints else [],
            compose_seconds=layout.compose_seconds,
            all_logits=None if every is None else every[layout.rows],
        ))
    return results


@torch.no_grad()
def run_stack(
    model: HybridModel, spans: list[Span], initial: DecodeState | None = None, assembly: Assembly | None = None, *,
    want_checkpoints: bool = False, want_all_logits: bool = False, observe_attention: AttentionObserver | None = None,
) -> StackResult:
    """One sequence through `run_batch` (spans contiguous, starting at `initial.length` or 0): its next-token
    logits, and the state after it as a `DecodeState` (`initial`, if given, is read, never written).
    observe_attention: a probe's hook, called by every attention layer (`layout.AttentionObserver`)."""
    item = StackItem(list(spans), initial, assembly or Assembly(), want_checkpoints,
                     observe_attention=observe_attention)
    [result] = run_batch(model, [item], want_all_logits=want_all_logits)
    return StackResult(
        logits=result.logits, state=result.state.to_decode_state(), recomputed_tokens=result.recomputed_tokens,
        all_logits=result.all_logits, checkpoints=result.checkpoints, compose_seconds=result.compose_seconds,
    )


def decode_batch(model: HybridModel, states: list[SequenceState], token_ids: list[int]) -> torch.Tensor:
    """Feed one token to each running sequence (of any lengths) in one pass: logits [B, vocab] float32; each state
    is advanced in place."""
    items = [StackItem([Span([int(token)], state.length, 1)], state) for state, token in zip(states, token_ids, strict=True)]
    return torch.stack([result.logits for result in run_batch(model, items)])


def _checkpoints(layout: Layout) -> list[DecodeState]:
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

SMALL_QUERY_TOKENS = 256
"""Up to this many queries per item, attention is two plain matmuls (`grouped_attention`: scores [H_kv, N, G*T] fit
easily); more (a `full` or `prefix` prefill) go through `layers.attention_core` (scaled_dot_product_attention)."""


def _attention_buffers(layout: Layout, layer_index: int, key: torch.Tensor, value: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The item's key / value buffers of this layer, [H_kv, capacity, D] / [H_kv, capacity, Dv]: made on first use
    (the item's length plus its reserve), like the layer's fresh keys and values."""
    state = layout.state
    keys = state.keys.get(layer_index)
    if keys is None:
        capacity = layout.total + layout.item.reserve
        keys = state.keys[layer_index] = key.new_empty(key.shape[0], capacity, key.shape[2])
        state.values[layer_index] = value.new_empty(value.shape[0], capacity, value.shape[2])
    return keys, state.values[layer_index]


def _attention_layer(mixer: AttentionMixer, layer_index: int, x: torch.Tensor, pass_: _Pass) -> torch.Tensor:
    """One attention mixer over the flat tokens x [R, hidden] of every item: projections and positions over all of
    them; each item's fresh keys / values written into its buffers at their positions (cached ones placed, and
    re-positioned when its assembly says so); each item's queries attend causally over its own keys. [R, hidden]."""
    positions = mixer.positions
    tables, index = pass_.position_tables(positions, x)
    projections = mixer.project(x)  # query [Hq, R, D], key [Hkv, R, D], value [Hkv, R, Dv]
    query = positions.apply(projections.query, tables, index)
    key = positions.apply(projections.key, tables, index)
    value = projections.value
    core = query.new_empty(x.shape[0], query.shape[0] * value.shape[2])
    for layout in pass_.layouts:
        keys, values = _attention_buffers(layout, layer_index, key, value)
        for span, (offset, count) in zip(layout.spans, layout.offsets):
            row = layout.row + offset
            if count:
                keys[:, span.start : span.start + count] = key[:, row : row + count]
                values[:, span.start : span.start + count] = value[:, row : row + count]
            if span.entry is not None and count < span.length:
                began = time.perf_counter()
                at = span.start + count
                values[:, at : span.start + span.length] = span.entry[tensor_name(layer_index, "value")][:, count:]
                position = at if layout.item.assembly.reposition_keys else count
                positions.place(keys, at, span.entry[tensor_name(layer_index, "key")][:, count:], tables, position)
                layout.compose_seconds += time.perf_counter() - began
        rows = layout.rows
        seen_keys, seen_values = keys[:, : layout.total], values[:, : layout.total]
        if layout.item.observe_attention is not None:
            layout.item.observe_attention(layer_index, mixer, query[:, rows], seen_keys, layout.positions,
                                          torch.arange(layout.total, device=x.device))
        if layout.recomputed <= SMALL_QUERY_TOKENS:  # seams + question, a decode token: two small matmuls
            core[rows] = grouped_attention(mixer.scaling, query[:, rows], seen_keys, seen_values, layout.positions)
        else:
            key_index = torch.arange(layout.total, device=x.device)
            core[rows] = L.attention_core(mixer, query[:, rows], seen_keys, seen_values, layout.positions, key_index)
    return mixer.output(core, projections)


def grouped_attention(
    scaling: float, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Causal attention of queries [Hq, T, D] at sequence `positions` [T] over keys [Hkv, N, D] / values
    [Hkv, N, Dv] at positions 0..N-1 (key j is seen by a query at p iff j <= p); the query heads of one kv head share
    its keys, which are read in place (no copy per query head, no transposed copy). Returns [T, Hq*Dv]: what
    `layers.attention_core` (scaled_dot_product_attention) gives, up to float32 round-off."""
    heads, tokens, head_dim = query.shape
    kv_heads, length, value_dim = keys.shape[0], keys.shape[1], values.shape[2]
    groups = heads // kv_heads
    grouped = query.reshape(kv_heads, groups * tokens, head_dim)  # head kv * groups + g, token t -> row g * T + t
    with wide_for(heads * tokens * length * (head_dim + value_dim)):
        scores = torch.matmul(grouped, keys.to(query.dtype).transpose(1, 2)).float()  # [Hkv, G*T, N]
        if tokens > 1 or int(positions[0]) < length - 1:  # some query may not see every key
            hidden = torch.arange(length, device=keys.device)[None, :] > positions[:, None]  # [T, N]
            scores = scores.view(kv_heads, groups, tokens, length).masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores.mul_(scaling), dim=-1).to(query.dtype).view(kv_heads, groups * tokens, length)
        out = torch.matmul(weights, values.to(query.dtype))  # [Hkv, G*T, Dv]
    return out.reshape(heads, tokens, value_dim).transpose(0, 1).reshape(tokens, heads * value_dim)

