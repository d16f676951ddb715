"""Zyphra Zamba2 (`zamba2`): every layer is a Mamba2 / SSD layer `h + mamba(norm(h + t))`; on "hybrid" layers t is
the output of a SHARED transformer block fed with concat(h, token embeddings), through the layer's own linear map;
t enters only the Mamba input, not the residual. The shared block's weights are tied across the hybrid layers of a
memory block, with per-layer q/k/v adapters (optional) and MLP adapters; each hybrid layer caches its own keys and
values. SSD time step clamped to (time_step_min, inf); the final norm is `final_layernorm`.
docs/families_ssm.md, section 2."""

from __future__ import annotations

import torch
from torch import nn

from hypic_rag.runtime.blocks import Block, BlockContext, MixFunction, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions, Positioner
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.mixers.zamba2 import SharedAttention


class HybridBlock(Block):
    """A Zamba2 hybrid layer over its `Zamba2HybridLayer` (`shared_transformer`, `linear`, `mamba_decoder`):
    a = attention(norm_2h(concat(h, e))); t = linear(mlp(norm(a))); h <- h + mamba(norm(h + t)).
    The shared MLP takes the model's layer index (it picks the layer's adapter)."""

    def __init__(self, layer: nn.Module, layer_index: int, positions: Positioner, adapter_index: int) -> None:
        self.layer, self.layer_index = layer, layer_index
        self.attention_mixer = SharedAttention(layer.shared_transformer.self_attn, positions, adapter_index)
        self.mamba_mixer = Mamba2Mixer(layer.mamba_decoder.mamba)
        self.mixers = (self.mamba_mixer, self.attention_mixer)
        self.check()

    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        shared = self.layer.shared_transformer
        joined = torch.cat([hidden, context.embeddings.to(hidden.dtype)], dim=-1)
        attended = mix(self.attention_mixer, shared.input_layernorm(joined))
        transformed = self.layer.linear(shared.feed_forward(shared.pre_ff_layernorm(attended), self.layer_index))
        mamba_input = self.layer.mamba_decoder.input_layernorm(hidden + transformed)
        return hidden + mix(self.mamba_mixer, mamba_input)


class Zamba2(Family):
    """Layers of `config.layers_block_type`: "linear_attention" (`Zamba2MambaDecoderLayer`: `mamba`,
    `input_layernorm`) or "hybrid" (`Zamba2HybridLayer`)."""

    model_types = ("zamba2",)
    final_norm_name = "final_layernorm"

    def positions(self, hf_model: nn.Module) -> Positioner:
        """RoPE (the model's rotary module) when `use_mem_rope`, else NoPE."""
        rotary = getattr(self.backbone(hf_model), "rotary_emb", None)
        return RotaryPositions(rotary) if hf_model.config.use_mem_rope and rotary is not None else NoPositions()

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        config = hf_model.config
        positions = self.positions(hf_model)
        adapter_of = {layer_index: rank for rank, layer_index in enumerate(config.hybrid_layer_ids)}
        blocks: list[Block] = []
        for layer_index, layer in enumerate(self.backbone(hf_model).layers):
            if layer_index in adapter_of:
                blocks.append(HybridBlock(layer, layer_index, positions, adapter_of[layer_index]))
            else:
                blocks.append(ResidualBlock(Mamba2Mixer(layer.mamba), layer.input_layernorm))
        return tuple(blocks)


ZAMBA2 = register_family(Zamba2())
