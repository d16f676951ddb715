"""What one stack pass runs: spans, the items (sequences) of a pass, and where each item's tokens lie in it.

A `Span` is a contiguous run of a sequence's tokens whose first `recompute` tokens go through the stack (the rest
come from its cached entry); a `StackItem` is one sequence's spans after its state; `lay_out` places the items'
recomputed tokens end to end (the flat token rows every token-wise op runs over) and records each item's
`Layout`, which the attention and recurrent layers of the pass read (`stack.py`, `recurrent_pass.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.entry.schema import Entry
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.state import DecodeState, LinearLayerState


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

    @property
    def cached(self) -> int:
        """Tokens taken from the entry (after the recomputed ones)."""
        return self.length - self.recompute if self.entry is not None else 0


AttentionObserver = Callable[[int, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""observe(layer_index, mixer, query [Hq, R, D], keys [Hkv, N, D], query_index [R], key_index [N]): what an
attention layer's core attends for one item, queries and keys positioned (a probe's hook, e.g. the question's
attention over cached chunks in `evals/policy_signals.py`)."""


@dataclass(slots=True)
class StackItem:
    """One sequence of a pass: `spans` (contiguous) after `state`.

    state: None (the spans start at position 0), a `DecodeState` (e.g. a prefix-mode checkpoint: copied, never
    written) or a running sequence's `SequenceState` (advanced in place). assembly: how the request is assembled
    (the stack reads whether cached keys are re-positioned and how cached states compose). want_checkpoints:
    decode states at each span end (prefix mode). reserve: room for this many more tokens in the attention buffers
    of a new state (the tokens the sequence will decode). observe_attention: called by every attention layer
    before its core, with this item's queries and keys (`AttentionObserver`: a probe's hook); None: no call.
    """

    spans: list[Span]
    state: SequenceState | DecodeState | None = None
    assembly: Assembly = field(default_factory=Assembly)
    want_checkpoints: bool = False
    reserve: int = 0
    observe_attention: AttentionObserver | None = None


def merge_recomputed_spans(spans: list[Span]) -> list[Span]:
    """Neighbouring spans recomputed whole run as one span (one recurrence call instead of one per span); exact,
    since nothing cached sits between them. Only when no per-span checkpoints are wanted."""
    merged: list[Span] = []
    for span in spans:
        if merged and span.entry is None and merged[-1].entry is None:
            last = merged[-1]
            merged[-1] = Span(last.token_ids + span.token_ids, last.start, last.recompute + span.recompute)
        else:
            merged.append(span)
    return merged


@dataclass(slots=True)
class Layout:
    """Where an item's tokens are in the pass: its spans with (offset, count) of their recomputed tokens among the
    item's, the item's first row among the flat tokens, its start position, its length after the pass, its
    recomputed token count and their positions [recomputed]. The pass fills in the state it writes, per span the
    linear states at its end (checkpoints) and the seconds spent composing cached state."""

    item: StackItem
    spans: list[Span]
    offsets: list[tuple[int, int]]
    row: int
    start: int
    total: int
    recomputed: int
    positions: torch.Tensor
    state: SequenceState = field(default_factory=lambda: SequenceState(0))
    span_linear: list[dict[int, LinearLayerState]] = field(default_factory=list)
    compose_seconds: float = 0.0

    @property
    def rows(self) -> slice:
        """The item's rows among the flat tokens."""
        return slice(self.row, self.row + self.recomputed)

    @property
    def composition(self) -> str:
        return self.item.assembly.composition

    @property
    def want_checkpoints(self) -> bool:
        return self.item.want_checkpoints

    def places_cached_keys(self) -> bool:
        """Whether some span of the item takes keys from its entry."""
        return any(span.cached for span in self.spans)

    def is_decode_step(self) -> bool:
        """One recomputed token after a state, no checkpoints: a decode step."""
        return (self.recomputed == 1 and len(self.spans) == 1 and self.spans[0].length == 1
                and self.start > 0 and not self.item.want_checkpoints)


def lay_out(items: list[StackItem], device: torch.device) -> tuple[list[Layout], list[int]]:
    """Layouts of `items` and the flat list of their recomputed token ids (item by item, span by span)."""
    layouts: list[Layout] = []
    flat_ids: list[int] = []
    for item in items:
        spans = item.spans if item.want_checkpoints else merge_recomputed_spans(item.spans)
        start = item.state.length if item.state is not None else 0
        position = start
        offsets: list[tuple[int, int]] = []
        positions: list[int] = []
        count = 0
        for span in spans:
            if span.start != position:
                raise ValueError(f"spans must be contiguous: expected a span at {position}, got {span.start}")
            if span.length == 0:
                raise ValueError("spans must not be empty")
            offsets.append((count, span.recompute))
            flat_ids.extend(span.token_ids[: span.recompute])
            positions.extend(range(span.start, span.start + span.recompute))
            count += span.recompute
            position += span.length
        if count == 0:
            raise ValueError("nothing to recompute: the last span (the question) must have recomputed tokens")
        layouts.append(Layout(
            item, spans, offsets, len(flat_ids) - count, start, position, count,
            torch.tensor(positions, dtype=torch.long, device=device), span_linear=[dict() for _ in spans],
        ))
    return layouts, flat_ids
