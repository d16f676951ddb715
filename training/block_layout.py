"""A differentiable forward in the cached layout: what `hypic` computes at query time, batched, for training.

At query time under `hypic` a chunk's tokens after its seam window never see the rest of the prompt: their hidden
states, K/V and linear-layer inputs are those of the chunk encoded alone from position 0 (the segment cache's
entry), re-positioned with RoPE and composed by the transition algebra. Only the prefix, each chunk's first
`seam` tokens and the question are computed with the true context. A model trained only on fully attended
contexts has never seen such standalone-encoded chunks; this forward lets training see exactly them.

Layout of one batch (B contexts of T tokens, N standalone documents of at most L tokens):
- `cached` [B, T] bool: the token's hidden state at every layer comes from the standalone encoding of its
  document (`source_row` [B, T], `source_position` [B, T] index the standalone batch);
- every other token is live: computed with the true context, in which cached tokens contribute their standalone
  keys/values (rotated at their true positions) and their standalone delta-rule inputs (q, k, v after the short
  convolution, gate and beta): the recurrence over them is the runtime's `h <- P h + Z` composition.

`block_layout_logits` with no cached token is the model's ordinary forward; with cached tokens its logits at live
positions equal `run_stack` under `hypic` (tests/training/test_block_layout.py checks both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.blocks import BlockContext
from hypic_rag.runtime.families import family_for
from hypic_rag.runtime.mixers.base import Mixer, Positioner, RecurrentMixer


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where the cached tokens of a [B, T] batch come from (see the module docstring).

    documents: [N, L] int64 token ids of the standalone documents (right-padded with `pad_token_id`);
    cached, source_row, source_position: [B, T].
    """

    documents: torch.Tensor
    cached: torch.Tensor
    source_row: torch.Tensor
    source_position: torch.Tensor

    @property
    def num_cached(self) -> int:
        return int(self.cached.sum())


def build_layout(
    token_ids: torch.Tensor,
    chunk_spans: Sequence[Sequence[tuple[int, int]]],
    seams: Sequence[int | None],
    pad_token_id: int,
) -> BlockLayout | None:
    """The layout of a collated batch token_ids [B, T].

    chunk_spans[b]: (start, length) of each chunk of context b; seams[b]: the seam window of its chunks, or None
    for a fully attended context. Chunk tokens at offsets >= seam are cached. None when nothing is cached.
    """
    batch, length = token_ids.shape
    cached = torch.zeros(batch, length, dtype=torch.bool)
    source_row = torch.zeros(batch, length, dtype=torch.long)
    source_position = torch.zeros(batch, length, dtype=torch.long)
    documents: list[torch.Tensor] = []
    for row, (spans, seam) in enumerate(zip(chunk_spans, seams)):
        if seam is None:
            continue
        if seam < 0:
            raise ValueError("seam must be >= 0")
        for start, size in spans:
            if seam >= size:
                continue  # a chunk no longer than its seam is recomputed whole
            documents.append(token_ids[row, start : start + size])
            cached[row, start + seam : start + size] = True
            source_row[row, start + seam : start + size] = len(documents) - 1
            source_position[row, start + seam : start + size] = torch.arange(seam, size)
    if not documents:
        return None
    longest = max(document.numel() for document in documents)
    padded = torch.full((len(documents), longest), pad_token_id, dtype=torch.long)
    for row, document in enumerate(documents):
        padded[row, : document.numel()] = document
    return BlockLayout(padded, cached, source_row, source_position)


def _gather(values: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """values [N, L, D] of the standalone batch at the positions of the cached tokens: [B, T, D]."""
    return values[layout.source_row, layout.source_position]


class _Tables:
    """Each positioner's tables for positions 0..length-1, computed once per forward."""

    def __init__(self, length: int, like: torch.Tensor) -> None:
        self.length, self.like, self.cache = length, like, {}

    def of(self, positions: Positioner):
        if id(positions) not in self.cache:
            self.cache[id(positions)] = positions.tables(torch.arange(self.length, device=self.like.device), self.like)
        return self.cache[id(positions)]


def _mix(
    mixer: Mixer,
    x: torch.Tensor,
    tables: _Tables,
    layout: BlockLayout | None = None,
    standalone_convolved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A mixer over x [B, T, hidden] (input-normalised) at positions 0..T-1 from a zero start, through the
    runtime's own mixer paths (differentiable).

    Recurrent mixers: with a layout, the convolved channels [N, L, C] of the standalone documents replace those of
    the cached tokens (whose other token-wise projections already match: x equals the standalone input there).
    Returns (output [B, T, hidden], the convolved channels [B, T, C] of a recurrent mixer, else None).
    """
    if isinstance(mixer, RecurrentMixer):
        projections = mixer.project(x)
        zero_context = mixer.empty_conv_tail(x.device)[None].expand(x.shape[0], -1, -1)
        convolved = mixer.convolve(projections.preconv, zero_context)
        if layout is not None and standalone_convolved is not None:
            convolved = torch.where(layout.cached[..., None], _gather(standalone_convolved, layout), convolved)
        core, _ = mixer.run(mixer.recurrence_inputs(convolved, projections))
        return mixer.output(core, projections, x.dtype), convolved
    positions = mixer.positions
    projections = mixer.project(x)
    table = tables.of(positions)
    everywhere = slice(None)
    core = L.causal_attention(
        mixer,
        positions.apply(projections.query, table, everywhere),
        positions.apply(projections.key, table, everywhere),
        projections.value,
    )
    return mixer.output(core, projections), None


def block_layout_logits(model: nn.Module, token_ids: torch.Tensor, layout: BlockLayout | None = None) -> torch.Tensor:
    """Logits [B, T, vocab] of a `Qwen3_5ForCausalLM`-style model over token_ids [B, T] in `layout`.

    Logits at cached positions are not meaningful (those tokens' predictions are made standalone); the caller
    masks their loss. Without a layout this is the model's ordinary causal forward.
    """
    family = family_for(model.config.model_type)
    if family is None:
        raise ValueError(f"model type {model.config.model_type!r} has no registered family")
    blocks = family.build_blocks(model)
    hidden = family.embed(model, token_ids)
    tables = _Tables(token_ids.shape[1], hidden)
    context = BlockContext(embeddings=hidden)
    standalone = None
    if layout is not None:
        standalone = family.embed(model, layout.documents)
        standalone_tables = _Tables(layout.documents.shape[1], standalone)
        standalone_context = BlockContext(embeddings=standalone)
    last = len(blocks) - 1
    for index, block in enumerate(blocks):
        standalone_convolved: list[torch.Tensor] = []
        if standalone is not None:
            hidden = torch.where(layout.cached[..., None], _gather(standalone, layout), hidden)
            if index < last or block.recurrent is not None:  # the standalone stream feeds the next layer's inputs

                def mix_standalone(mixer: Mixer, x: torch.Tensor, recorded: list = standalone_convolved) -> torch.Tensor:
                    out, convolved = _mix(mixer, x, standalone_tables)
                    if convolved is not None:
                        recorded.append(convolved)
                    return out

                advanced = block.forward(standalone, mix_standalone, standalone_context)
                if index < last:
                    standalone = advanced

        def mix_live(mixer: Mixer, x: torch.Tensor, recorded: list = standalone_convolved) -> torch.Tensor:
            return _mix(mixer, x, tables, layout, recorded[0] if recorded else None)[0]

        hidden = block.forward(hidden, mix_live, context)
    return family.logits(model, hidden)
