"""OLMo-Hybrid (`olmo_hybrid`): Gated DeltaNet layers (pre-norm) and attention layers with post-norms (no input norm:
h += norm(attn(h)); h += norm(mlp(h))); NoPE unless the config sets a RoPE theta; a dense SwiGLU MLP everywhere."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, BlockContext, MixFunction, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.layers import call_mlp
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import AttentionMixer, NoPositions, Positioner
from hypic_rag.runtime.mixers.olmo_hybrid import OlmoGatedDeltaNetMixer, WholeNormAttention


class PostNormBlock(Block):
    """h <- h + mixer_norm(mixer(h)); h <- h + mlp_norm(mlp(h)) (OLMo's attention layers: norms on the outputs)."""

    def __init__(self, mixer: AttentionMixer, mixer_norm: nn.Module, mlp: nn.Module, mlp_norm: nn.Module) -> None:
        self.mixer, self.mixer_norm, self.mlp, self.mlp_norm = mixer, mixer_norm, mlp, mlp_norm
        self.mixers = (mixer,)
        self.check()

    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        hidden = hidden + self.mixer_norm(mix(self.mixer, hidden))
        return hidden + self.mlp_norm(call_mlp(self.mlp, hidden))


class OlmoHybrid(Family):
    """Layers of `config.layer_types`: "linear_attention" (`linear_attn`, input_layernorm, post_attention_layernorm)
    or "full_attention" (`self_attn`, post_attention_layernorm, post_feedforward_layernorm)."""

    model_types = ("olmo_hybrid",)

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def positions(self, hf_model: nn.Module) -> Positioner:
        """RoPE through the model's rotary module when it has one; the released checkpoints have none (NoPE)."""
        rotary = getattr(self.backbone(hf_model), "rotary_emb", None)
        return NoPositions() if rotary is None else RotaryPositions(rotary)

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = self.positions(hf_model)
        blocks: list[Block] = []
        for layer, kind in zip(self.backbone(hf_model).layers, hf_model.config.layer_types):
            if kind == LINEAR_LAYER:
                mixer = OlmoGatedDeltaNetMixer(layer.linear_attn)
                blocks.append(ResidualBlock(mixer, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm))
            else:
                attention = WholeNormAttention(layer.self_attn, positions)
                blocks.append(PostNormBlock(attention, layer.post_attention_layernorm, layer.mlp,
                                            layer.post_feedforward_layernorm))
        return tuple(blocks)


OLMO_HYBRID = register_family(OlmoHybrid())
