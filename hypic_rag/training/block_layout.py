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
positions equal `run_stack` under `hypic` (tests/test_block_layout.py checks both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.model import LINEAR_LAYER


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
    """Gated DeltaNet over x [B, T, hidden] (input-normalised), zero start.

    With a layout, the convolved q/k/v channels [N, L, C] of the standalone documents replace those of the cached
    tokens (whose gate and beta already match: they are token-local and x equals the standalone input there).
    Returns (output [B, T, hidden], convolved channels [B, T, C]).
    """
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    batch, length, _ = x.shape
    preconv = mixer.in_proj_qkv(x)  # [B, T, C]
    kernel = mixer.conv_kernel_size
    convolved = F.conv1d(F.pad(preconv.transpose(1, 2), (kernel - 1, 0)), mixer.conv1d.weight, mixer.conv1d.bias,
                         groups=preconv.shape[-1])
    convolved = F.silu(convolved).transpose(1, 2)  # [B, T, C]
    if layout is not None and standalone_convolved is not None:
        convolved = torch.where(layout.cached[..., None], _gather(standalone_convolved, layout), convolved)
    query, key, value = torch.split(convolved, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    query = query.reshape(batch, length, -1, mixer.head_k_dim)
    key = key.reshape(batch, length, -1, mixer.head_k_dim)
    value = value.reshape(batch, length, -1, mixer.head_v_dim)
    if mixer.num_v_heads != mixer.num_k_heads:
        repeat = mixer.num_v_heads // mixer.num_k_heads
        query = query.repeat_interleave(repeat, dim=2)
        key = key.repeat_interleave(repeat, dim=2)
    beta = mixer.in_proj_b(x).sigmoid()
    log_decay = -mixer.A_log.float().exp() * F.softplus(mixer.in_proj_a(x).float() + mixer.dt_bias)
    core, _ = torch_chunk_gated_delta_rule(query, key, value, g=log_decay, beta=beta, initial_state=None,
                                           output_final_state=False, use_qk_l2norm_in_kernel=True)
    gate = mixer.in_proj_z(x).reshape(-1, mixer.head_v_dim)
    core = mixer.norm(core.reshape(-1, mixer.head_v_dim).to(x.dtype), gate).reshape(batch, length, -1)
    return mixer.out_proj(core), convolved


def _attention(attention: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal gated attention over x [B, T, hidden] at positions 0..T-1 (cos, sin [T, R])."""
    batch, length, _ = x.shape
    head_dim = attention.head_dim
    projected = attention.q_proj(x)
    heads = attention.config.num_attention_heads
    if projected.shape[-1] == heads * head_dim * 2:
        query, gate = torch.chunk(projected.view(batch, length, heads, head_dim * 2), 2, dim=-1)
        gate = gate.reshape(batch, length, -1)
    else:
        query, gate = projected.view(batch, length, heads, head_dim), None
    query = L.apply_rotary(attention.q_norm(query).transpose(1, 2), cos, sin)
    key = L.apply_rotary(attention.k_norm(attention.k_proj(x).view(batch, length, -1, head_dim)).transpose(1, 2), cos, sin)
    value = attention.v_proj(x).view(batch, length, -1, head_dim).transpose(1, 2)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    core = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=attention.scaling)
    core = core.transpose(1, 2).reshape(batch, length, -1)
    if gate is not None:
        core = core * torch.sigmoid(gate)
    return attention.o_proj(core)


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
