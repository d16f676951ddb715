"""AI21 Jamba (`jamba`): Mamba1 layers (selective scan, elementwise transition) and full attention without RoPE,
each followed by a SwiGLU MLP or a top-k MoE block (`feed_forward`, independent of the mixer kind); the final norm
is `final_layernorm`. docs/families_ssm.md, sections 2 and 3."""

from __future__ import annotations

from torch import nn

from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.mamba1 import Mamba1Mixer

JAMBA_LAYER_KINDS = ("mamba", "attention")


class Jamba(Family):
    """Layers of `config.layers_block_type`: "mamba" (`layer.mamba`) or "attention" (`layer.self_attn`, NoPE), each
    with input_layernorm, pre_ff_layernorm and feed_forward (MLP or MoE)."""

    model_types = ("jamba",)
    final_norm_name = "final_layernorm"
    layer_kinds_field = "layers_block_type"
    known_layer_kinds = JAMBA_LAYER_KINDS

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = NoPositions()
        blocks: list[Block] = []
        for layer in self.backbone(hf_model).layers:
            mamba = getattr(layer, "mamba", None)
            mixer = Mamba1Mixer(mamba) if mamba is not None else ProjectedAttention(layer.self_attn, positions)
            blocks.append(ResidualBlock(mixer, layer.input_layernorm, layer.feed_forward, layer.pre_ff_layernorm))
        return tuple(blocks)


JAMBA = register_family(Jamba())
