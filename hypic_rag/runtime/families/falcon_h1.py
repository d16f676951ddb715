"""TII Falcon-H1 (`falcon_h1`): a parallel hybrid, every layer runs a Mamba2 / SSD mixer and RoPE attention side by
side on the same normed input and adds both, with muP multipliers everywhere:
`h + ssm_out * mamba(ssm_in * n) + attention_out * attention(attention_in * n)`, n = input_layernorm(h); then the
SwiGLU MLP (its own gate / down multipliers, inside the module). Embeddings times `embedding_multiplier`, logits times
`lm_head_multiplier`; the final norm is `final_layernorm`. Every layer caches a linear state AND keys / values.
docs/families_ssm.md, sections 2 and 4."""

from __future__ import annotations

import torch
from torch import nn

from hypic_rag.runtime.blocks import Block, Branch, ParallelBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.falcon_h1 import FalconH1Mamba2Mixer, KeyScaledAttention


class FalconH1(Family):
    """Layers with `mamba`, `self_attn`, `input_layernorm`, `feed_forward`, `pre_ff_layernorm`."""

    model_types = ("falcon_h1",)
    final_norm_name = "final_layernorm"

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        config = hf_model.config
        positions = RotaryPositions(self.backbone(hf_model).rotary_emb)
        blocks: list[Block] = []
        for layer in self.backbone(hf_model).layers:
            branches = (
                Branch(FalconH1Mamba2Mixer(layer.mamba), config.ssm_in_multiplier, config.ssm_out_multiplier),
                Branch(KeyScaledAttention(layer.self_attn, positions), config.attention_in_multiplier,
                       config.attention_out_multiplier),
            )
            blocks.append(ParallelBlock(branches, layer.input_layernorm, layer.feed_forward, layer.pre_ff_layernorm))
        return tuple(blocks)

    def embed(self, hf_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        backbone = self.backbone(hf_model)
        return backbone.embed_tokens(ids) * backbone.embedding_multiplier

    def logits(self, hf_model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        backbone = self.backbone(hf_model)
        return (hf_model.lm_head(backbone.final_layernorm(hidden)) * backbone.lm_head_multiplier).float()


FALCON_H1 = register_family(FalconH1())
