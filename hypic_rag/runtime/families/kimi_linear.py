"""Kimi-Linear (`kimi_linear`): KDA linear layers and MLA attention without RoPE (NoPE), pre-norm blocks, a dense
MLP in the first `first_k_dense_replace` layers and a group-routed MoE with a shared expert after them."""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.base import Mixer, NoPositions, Positioner
from hypic_rag.runtime.mixers.kda import KdaMixer
from hypic_rag.runtime.mixers.latent_attention import LatentAttention


class KimiLinear(Family):
    """Layers of `config.layer_types`: "linear_attention" (`self_attn` is the KDA module) or "full_attention"
    (`self_attn` is MLA), each with input_layernorm, post_attention_layernorm and mlp (dense or MoE)."""

    model_types = ("kimi_linear",)

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def positions(self, hf_model: nn.Module) -> Positioner:
        """How the MLA layers position queries and keys: Kimi's MLA has no RoPE."""
        return NoPositions()

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = self.positions(hf_model)
        blocks: list[Block] = []
        for layer, kind in zip(self.backbone(hf_model).layers, hf_model.config.layer_types):
            if kind == LINEAR_LAYER:
                mixer: Mixer = KdaMixer(layer.self_attn)
            else:
                mixer = LatentAttention(layer.self_attn, positions)
            blocks.append(ResidualBlock(mixer, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm))
        return tuple(blocks)


KIMI_LINEAR = register_family(KimiLinear())
