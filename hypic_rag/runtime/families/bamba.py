"""IBM Bamba (`bamba`): Mamba2 / SSD layers and llama-style attention with partial RoPE (the first half of each
head's dims rotate: `partial_rotary_factor` is fixed to 0.5 by the config), each followed by a SwiGLU MLP; the final
norm is `final_layernorm`. docs/families_ssm.md, sections 1 and 2."""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer


class Bamba(Family):
    """Layers of `config.layers_block_type`: "linear_attention" (`layer.mamba`) or "full_attention"
    (`layer.self_attn`), each with input_layernorm, pre_ff_layernorm and feed_forward."""

    model_types = ("bamba",)
    final_norm_name = "final_layernorm"

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layers_block_type if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = RotaryPositions(self.backbone(hf_model).rotary_emb)
        blocks: list[Block] = []
        for layer in self.backbone(hf_model).layers:
            mamba = getattr(layer, "mamba", None)
            mixer = Mamba2Mixer(mamba) if mamba is not None else ProjectedAttention(layer.self_attn, positions)
            blocks.append(ResidualBlock(mixer, layer.input_layernorm, layer.feed_forward, layer.pre_ff_layernorm))
        return tuple(blocks)


BAMBA = register_family(Bamba())
