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
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.model import LINEAR_LAYER
from hypic_rag.runtime.ops.gated_delta_rule import chunk_gated_delta_rule


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


def _linear_mixer(
    mixer: nn.Module,
    x: torch.Tensor,
    layout: BlockLayout | None = None,
    standalone_convolved: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet over x [B, T, hidden] (input-normalised), zero start, through the runtime's own mixer paths
    (`runtime/layers.py`) and chunked delta rule (differentiable; fla's kernel on CUDA).

    With a layout, the convolved q/k/v channels [N, L, C] of the standalone documents replace those of the cached
    tokens (whose gate and beta already match: they are token-local and x equals the standalone input there).
    Returns (output [B, T, hidden], convolved channels [B, T, C]).
    """
    preconv, output_gate, b, a = L.linear_projections(mixer, x)
    zero_context = L.empty_conv_tail(mixer, x.device)[None].expand(x.shape[0], -1, -1)
    convolved = L.short_convolution(mixer, preconv, zero_context)
    if layout is not None and standalone_convolved is not None:
        convolved = torch.where(layout.cached[..., None], _gather(standalone_convolved, layout), convolved)
    core, _ = chunk_gated_delta_rule(*L.split_delta_rule_inputs(mixer, convolved, b, a))
    return L.linear_mixer_output(mixer, core, output_gate, x.dtype), convolved


def _attention(attention: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal gated attention over x [B, T, hidden] at positions 0..T-1 (cos, sin [T, R])."""
    query, key, value, gate = L.attention_inputs(attention, x)
    query, key = L.apply_rotary(query, cos, sin), L.apply_rotary(key, cos, sin)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    core = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=attention.scaling)
    return L.attention_output(attention, core.transpose(1, 2).reshape(*x.shape[:-1], -1), gate)


def _mlp(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer.mlp(x)
    return out[0] if isinstance(out, tuple) else out


def block_layout_logits(model: nn.Module, token_ids: torch.Tensor, layout: BlockLayout | None = None) -> torch.Tensor:
    """Logits [B, T, vocab] of a `Qwen3_5ForCausalLM`-style model over token_ids [B, T] in `layout`.

    Logits at cached positions are not meaningful (those tokens' predictions are made standalone); the caller
    masks their loss. Without a layout this is the model's ordinary causal forward.
    """
    backbone = model.model
    layer_types = model.config.layer_types
    hidden = backbone.embed_tokens(token_ids)
    cos, sin = L.rotary_tables(backbone.rotary_emb, torch.arange(token_ids.shape[1], device=token_ids.device), hidden)
    standalone = None
    if layout is not None:
        standalone = backbone.embed_tokens(layout.documents)
        standalone_cos, standalone_sin = L.rotary_tables(
            backbone.rotary_emb, torch.arange(layout.documents.shape[1], device=token_ids.device), standalone
        )
    last = len(backbone.layers) - 1
    for index, layer in enumerate(backbone.layers):
        standalone_convolved = None
        if standalone is not None:
            hidden = torch.where(layout.cached[..., None], _gather(standalone, layout), hidden)
            normed = layer.input_layernorm(standalone)
            if layer_types[index] == LINEAR_LAYER:
                mixed, standalone_convolved = _linear_mixer(layer.linear_attn, normed)
            elif index < last:
                mixed = _attention(layer.self_attn, normed, standalone_cos, standalone_sin)
            if index < last:  # the standalone stream feeds the next layer's cached inputs
                standalone = standalone + mixed
                standalone = standalone + _mlp(layer, layer.post_attention_layernorm(standalone))
        normed = layer.input_layernorm(hidden)
        if layer_types[index] == LINEAR_LAYER:
            mixed, _ = _linear_mixer(layer.linear_attn, normed, layout, standalone_convolved)
        else:
            mixed = _attention(layer.self_attn, normed, cos, sin)
        hidden = hidden + mixed
        hidden = hidden + _mlp(layer, layer.post_attention_layernorm(hidden))
    return model.lm_head(backbone.norm(hidden))
