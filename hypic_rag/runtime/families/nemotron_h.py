"""NVIDIA Nemotron-H (`nemotron_h`): every layer is ONE pre-norm residual mixer, by `config.layers_block_type`:
Mamba2 / SSD ("linear_attention"), attention without RoPE ("full_attention"), a squared-ReLU MLP ("mlp") or an MoE
block ("moe"); MLP and MoE layers are MLP-only blocks that carry no cache entry. The SSD time step is clamped to
the mixer module's `time_step_limit` (transformers 5.25 takes it from the config; before, (time_step_min, inf)).
Embeddings are `embeddings`, the final norm `norm_f`. docs/families_ssm.md, sections 1-2."""

from __future__ import annotations

from typing import Any

from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer

FEED_FORWARD_KINDS = ("mlp", "moe")
"""Nemotron-H layer kinds that are a feed-forward block alone (no token mixer)."""


class NemotronH(Family):
    """Layers `layer.norm` + `layer.mixer`, the mixer's kind from `config.layers_block_type`."""

    model_types = ("nemotron_h",)
    embeddings_name = "embeddings"
    final_norm_name = "norm_f"

    def unsupported_reason(self, config: Any) -> str | None:
        known = (LINEAR_LAYER, ATTENTION_LAYER, *FEED_FORWARD_KINDS)
        unknown = sorted({kind for kind in config.layers_block_type if kind not in known})
        return f"unknown layer type {unknown[0]!r}" if unknown else None

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = NoPositions()
        blocks: list[Block] = []
        for layer in self.backbone(hf_model).layers:
            if layer.block_type == LINEAR_LAYER:
                blocks.append(ResidualBlock(Mamba2Mixer(layer.mixer), layer.norm))
            elif layer.block_type == ATTENTION_LAYER:
                blocks.append(ResidualBlock(ProjectedAttention(layer.mixer, positions), layer.norm))
            else:  # an MLP or MoE layer: h + ffn(norm(h)), nothing cached
                blocks.append(ResidualBlock(None, None, layer.mixer, layer.norm))
        return tuple(blocks)


NEMOTRON_H = register_family(NemotronH())
