"""Qwen3.5 (dense and MoE, text or multimodal checkpoints) and Qwen3-Next: Gated DeltaNet and gated attention with
(partial, M-)RoPE, one mixer per layer, then the MLP or MoE block."""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.base import Positioner
from hypic_rag.runtime.mixers.gated_deltanet import GatedDeltaNetMixer


class QwenHybrid(Family):
    """Layers of `config.layer_types`: "linear_attention" (`layer.linear_attn`) or "full_attention"
    (`layer.self_attn`), each with input_layernorm, post_attention_layernorm and mlp."""

    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def structure_problem(self, hf_model: nn.Module) -> str | None:
        problem = super().structure_problem(hf_model)
        if problem is None and getattr(self.backbone(hf_model), "rotary_emb", None) is None:
            return f"{type(hf_model).__name__} has no rotary embedding"
        return problem

    def positions(self, hf_model: nn.Module) -> Positioner:
        """How the attention layers position queries and keys: the model's rotary embedding."""
        return RotaryPositions(self.backbone(hf_model).rotary_emb)

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        backbone = self.backbone(hf_model)
        positions = self.positions(hf_model)
        blocks: list[Block] = []
        for layer in backbone.layers:
            if getattr(layer, "linear_attn", None) is not None:
                mixer = GatedDeltaNetMixer(layer.linear_attn)
            else:
                mixer = ProjectedAttention(layer.self_attn, positions)
            blocks.append(ResidualBlock(mixer, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm))
        return tuple(blocks)


QWEN_HYBRID = register_family(QwenHybrid())
