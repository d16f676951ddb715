"""LiquidAI LFM2 (`lfm2`): gated short-convolution layers (no recurrent state: an entry holds their conv tails)
and RoPE attention with per-head q/k layer norms; every layer then a SwiGLU MLP. The final norm is
`embedding_norm`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.short_conv import ShortConvMixer


class Lfm2(Family):
    """Layers of `config.layer_types`: "conv" (`layer.conv`) or "full_attention" (`layer.self_attn`), each with
    operator_norm, ffn_norm and feed_forward."""

    model_types = ("lfm2",)

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in ("conv", ATTENTION_LAYER)})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def structure_problem(self, hf_model: nn.Module) -> str | None:
        backbone = self.backbone(hf_model)
        parts = [getattr(backbone, name, None) for name in ("embed_tokens", "layers", "embedding_norm", "rotary_emb")]
        if any(part is None for part in parts) or getattr(hf_model, "lm_head", None) is None:
            return f"{type(hf_model).__name__} is not an LFM2 causal LM with a language-model head"
        return None

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        backbone = self.backbone(hf_model)
        positions = RotaryPositions(backbone.rotary_emb)
        blocks: list[Block] = []
        for layer in backbone.layers:
            if layer.is_attention_layer:
                attention = layer.self_attn
                mixer = ProjectedAttention(
                    attention, positions, q_norm=attention.q_layernorm, k_norm=attention.k_layernorm,
                    o_proj=attention.out_proj,
                )
            else:
                mixer = ShortConvMixer(layer.conv)
            blocks.append(ResidualBlock(mixer, layer.operator_norm, layer.feed_forward, layer.ffn_norm))
        return tuple(blocks)

    def logits(self, hf_model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return hf_model.lm_head(self.backbone(hf_model).embedding_norm(hidden)).float()


LFM2 = register_family(Lfm2())
