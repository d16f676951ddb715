"""Study rules that choose what to recompute from the model's own signals (issue 29), measured beside the runtime's
policies by `evals/recompute_policies.py`. They need more than a plan from lengths and ranks, so they live here.

- `attention:N@W`: a probe pass (the request at seam W, every chunk from its entry) records the question's attention
  over each chunk's cached keys in the last full-attention layer (the stack's `observe_attention` hook); the N chunks
  holding the most attention are then recomputed whole, the others at seam W, in a second pass. The probe is an
  extra pass: its recomputed tokens (the question and the seams) are counted with the final pass's.
- `deviation:N@W`: a statistic of each chunk measured once at encoding, against a generic preceding context (the
  prompt prefix's anchor, `hypic_rag.runtime.anchoring`): how far the chunk's last-attention-layer keys and values
  move when it is encoded after that context instead of alone (relative RMS). The N chunks that move most are
  recomputed whole, the others at seam W. No probe; one number (4 bytes) per chunk, and a second encoding of each
  chunk at ingestion.

Anchored entries themselves (`seam@0+anchored`, ...) are a runtime policy (`hypic_rag.runtime.recompute_policy`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.anchoring import anchor_of, anchored_key, chunk_view
from hypic_rag.runtime.recompute_policy import WHOLE, RecomputePlan, RecomputePolicy

SIGNAL_RULE = re.compile(r"(?P<signal>attention|deviation):(?P<chunks>\d+)@(?P<seam>\d+)")
"""`attention:N@W` or `deviation:N@W`."""


@dataclass(frozen=True, slots=True)
class FixedPlan:
    """A plan decided before the prefill (`PlansChunks`): these chunk seams, whatever the lengths and ranks."""

    chunk_seams: tuple[int | None, ...]

    def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()) -> RecomputePlan:
        if len(chunk_lengths) != len(self.chunk_seams):
            raise ValueError(f"a fixed plan of {len(self.chunk_seams)} chunks for {len(chunk_lengths)}")
        return RecomputePlan(self.chunk_seams)


@dataclass(slots=True)
class QuestionAttention:
    """The stack's `observe_attention` hook of a probe: per attention layer, the attention of the last
    `question_tokens` queries (the question), averaged over heads and question tokens, per key position [N]."""

    question_tokens: int
    mass: dict[int, torch.Tensor] = field(default_factory=dict)

    def __call__(self, layer_index: int, mixer: Any, query: torch.Tensor, keys: torch.Tensor,
                 query_index: torch.Tensor, key_index: torch.Tensor) -> None:
        rows = query[:, -self.question_tokens:]  # [Hq, Q, D]
        expanded = keys.repeat_interleave(rows.shape[0] // keys.shape[0], 0).to(rows.dtype)  # [Hq, N, D]
        scores = torch.einsum("hqd,hkd->hqk", rows, expanded).float() * mixer.scaling
        visible = key_index[None, :] <= query_index[-self.question_tokens:, None]  # [Q, N]
        weights = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
        self.mass[layer_index] = weights.mean(dim=(0, 1))


def chunk_spans(request: Any) -> list[tuple[int, int]]:
    """(first position, end position) of each chunk of `request` in its prompt."""
    spans, position = [], len(request.prefix_ids)
    for chunk in request.chunk_ids:
        spans.append((position, position + len(chunk)))
        position += len(chunk)
    return spans


def top_chunks(scores: Sequence[float], count: int) -> set[int]:
    """The `count` chunks of highest score (ties: earlier first)."""
    return set(sorted(range(len(scores)), key=lambda number: (-scores[number], number))[:count])


def whole_plan(chunks: int, chosen: set[int], seam: int) -> FixedPlan:
    return FixedPlan(tuple(WHOLE if number in chosen else seam for number in range(chunks)))


def last_attention_layer(model: Any) -> int:
    """The index of the model's last block with an attention mixer."""
    layers = [index for index, block in enumerate(model.blocks) if block.attention is not None]
    if not layers:
        raise ValueError("the model has no attention layer: no attention signal")
    return layers[-1]


def prefill_by_attention(engine: Any, request: Any, chunks: int, seam: int):
    """`attention:chunks@seam`: the probe at seam `seam`, then the `chunks` chunks of most question attention (last
    attention layer) recomputed whole. Returns (logits [vocab], state, tokens recomputed by both passes, chosen)."""
    from hypic_rag.runtime.stack import run_batch

    probe_plan = engine.plan_prefill(request, "hypic", policy=RecomputePolicy("seam", seam_tokens=seam))
    observer = QuestionAttention(len(request.question_ids))
    item = probe_plan.item()
    item.observe_attention = observer
    [probe] = run_batch(engine.model, [item])
    mass = observer.mass[last_attention_layer(engine.model)]
    scores = [float(mass[begin:end].sum()) for begin, end in chunk_spans(request)]
    chosen = top_chunks(scores, chunks)
    result = engine.prefill(request, "hypic", policy=whole_plan(len(request.chunk_ids), chosen, seam))
    return result.logits, result.state, probe.recomputed_tokens + result.stats.recomputed_tokens, chosen


class DeviationIndex:
    """Per chunk (by token ids), the relative RMS change of its last-attention-layer K/V when encoded after the
    anchor rather than alone: what an index would compute once per chunk at ingestion and keep (4 bytes)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.layer = last_attention_layer(engine.model)
        self._known: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}

    def deviation(self, anchor: Sequence[int], chunk_ids: Sequence[int]) -> float:
        key = (tuple(anchor), tuple(chunk_ids))
        if key not in self._known:
            from hypic_rag.runtime.engine import PrefillStats

            stats = PrefillStats(mode="hypic")
            plain = self.engine.fetch_entries([list(chunk_ids)], 0, stats)[0]
            seam, ids = anchored_key(anchor, chunk_ids, 0)
            anchored = chunk_view(self.engine.fetch_entries([list(ids)], seam, stats)[0], len(anchor), 0)
            moved = reference = 0.0
            for part in ("key", "value"):
                name = tensor_name(self.layer, part)
                moved += float((anchored[name].float() - plain[name].float()).pow(2).sum())
                reference += float(plain[name].float().pow(2).sum())
            self._known[key] = (moved / max(reference, 1e-30)) ** 0.5
        return self._known[key]


def prefill_by_deviation(engine: Any, deviations: DeviationIndex, request: Any, chunks: int, seam: int):
    """`deviation:chunks@seam`: the `chunks` chunks whose K/V move most when anchored, recomputed whole. Returns
    (logits [vocab], state, tokens recomputed, chosen)."""
    anchor = anchor_of(request.prefix_ids)
    scores = [deviations.deviation(anchor, chunk) for chunk in request.chunk_ids]
    chosen = top_chunks(scores, chunks)
    result = engine.prefill(request, "hypic", policy=whole_plan(len(request.chunk_ids), chosen, seam))
    return result.logits, result.state, result.stats.recomputed_tokens, chosen
