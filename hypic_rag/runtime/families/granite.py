"""IBM Granite 4.0-H (`granitemoehybrid`): Mamba2 / SSD layers and full attention (NoPE unless the config asks for
RoPE), each followed by an MoE block plus a shared MLP (or the shared MLP alone in dense models), residuals scaled
by `residual_multiplier`, embeddings times `embedding_multiplier`, logits divided by `logits_scaling`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, ResidualBlock
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.layers import call_mlp
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions, Positioner
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer


class SharedAndRoutedMLP(nn.Module):
    """Granite's feed-forward: moe(x) + shared_mlp(x), or shared_mlp(x) alone when the layer has no experts.
    x [n, T, hidden]. Holds no weights of its own (its parts are the layer's modules)."""

    def __init__(self, shared: nn.Module, routed: nn.Module | None) -> None:
        super().__init__()
        self.shared, self.routed = shared, routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared(x)
        return out if self.routed is None else out + call_mlp(self.routed, x)


class GraniteHybrid(Family):
    """Layers of `config.layer_types`: "linear_attention" (`layer.mamba`) or "full_attention" (`layer.self_attn`),
    input_layernorm, post_attention_layernorm, `block_sparse_moe` (None without experts) and `shared_mlp`."""

    model_types = ("granitemoehybrid",)

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        if unknown:
            return f"unknown layer type {unknown[0]!r}"
        if config.position_embedding_type not in (None, "nope", "rope"):
            return f"position_embedding_type {config.position_embedding_type!r} is not supported (rope or none)"
        return None

    def positions(self, hf_model: nn.Module) -> Positioner:
        rotary = getattr(self.backbone(hf_model), "rotary_emb", None)
        return NoPositions() if rotary is None else RotaryPositions(rotary)

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        positions = self.positions(hf_model)
        blocks: list[Block] = []
        for layer in self.backbone(hf_model).layers:
            if layer.mamba is not None:
                mixer = Mamba2Mixer(layer.mamba)
            else:
                mixer = ProjectedAttention(layer.self_attn, positions)
            mlp = SharedAndRoutedMLP(layer.shared_mlp, layer.block_sparse_moe if layer.has_experts else None)
            blocks.append(
                ResidualBlock(mixer, layer.input_layernorm, mlp, layer.post_attention_layernorm, layer.residual_multiplier)
            )
        return tuple(blocks)

    def embed(self, hf_model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        backbone = self.backbone(hf_model)
        return backbone.embed_tokens(ids) * backbone.embedding_multiplier

    def logits(self, hf_model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        logits = hf_model.lm_head(self.backbone(hf_model).norm(hidden))
        return (logits / hf_model.config.logits_scaling).float()


GRANITE_HYBRID = register_family(GraniteHybrid())
