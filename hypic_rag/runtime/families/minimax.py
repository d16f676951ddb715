"""MiniMax-Text (`minimax`): lightning-attention and softmax-attention (GQA, RoPE) layers, DeepNorm-style blocks whose
residual is the NORMALISED stream, scaled by per-layer-type (alpha, beta) factors, and a top-2 MoE on every layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.entry.schema import ATTENTION_LAYER, LINEAR_LAYER
from hypic_rag.runtime.blocks import Block, BlockContext, MixFunction
from hypic_rag.runtime.families.base import Family, register_family
from hypic_rag.runtime.layers import call_mlp
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.base import Mixer
from hypic_rag.runtime.mixers.lightning import LightningMixer


class ScaledPostNormBlock(Block):
    """h <- input_norm(h); h <- alpha h + beta mixer(h); h <- mlp_norm(h); h <- mlp_alpha h + mlp_beta mlp(h)."""

    def __init__(self, mixer: Mixer, input_norm: nn.Module, mlp: nn.Module, mlp_norm: nn.Module,
                 factors: tuple[float, float, float, float]) -> None:
        self.mixer, self.input_norm, self.mlp, self.mlp_norm = mixer, input_norm, mlp, mlp_norm
        self.alpha, self.beta, self.mlp_alpha, self.mlp_beta = (float(factor) for factor in factors)
        self.mixers = (mixer,)
        self.check()

    def forward(self, hidden: torch.Tensor, mix: MixFunction, context: BlockContext) -> torch.Tensor:
        hidden = self.input_norm(hidden)
        hidden = self.mlp_norm(hidden * self.alpha + mix(self.mixer, hidden) * self.beta)
        return hidden * self.mlp_alpha + call_mlp(self.mlp, hidden) * self.mlp_beta


class MiniMax(Family):
    """Layers of `config.layer_types`: "linear_attention" (`self_attn` is lightning attention) or "full_attention"
    (softmax attention), each with input_layernorm, post_attention_layernorm and the MoE `mlp`."""

    model_types = ("minimax",)

    def unsupported_reason(self, config: Any) -> str | None:
        unknown = sorted({kind for kind in config.layer_types if kind not in (LINEAR_LAYER, ATTENTION_LAYER)})
        if unknown:
            return f"unknown layer type {unknown[0]!r}"
        if getattr(config, "sliding_window", None) is not None:
            return "sliding-window attention (config.sliding_window) is not supported; only full attention is"
        return None

    def structure_problem(self, hf_model: nn.Module) -> str | None:
        problem = super().structure_problem(hf_model)
        if problem is None and getattr(self.backbone(hf_model), "rotary_emb", None) is None:
            return f"{type(hf_model).__name__} has no rotary embedding"
        return problem

    def build_blocks(self, hf_model: nn.Module) -> tuple[Block, ...]:
        config = hf_model.config
        positions = RotaryPositions(self.backbone(hf_model).rotary_emb)
        blocks: list[Block] = []
        for layer, kind in zip(self.backbone(hf_model).layers, config.layer_types):
            if kind == LINEAR_LAYER:
                mixer: Mixer = LightningMixer(layer.self_attn)
                alpha, beta = config.linear_attn_alpha_factor, config.linear_attn_beta_factor
            else:
                mixer = ProjectedAttention(layer.self_attn, positions)
                alpha, beta = config.full_attn_alpha_factor, config.full_attn_beta_factor
            factors = (alpha, beta, config.mlp_alpha_factor, config.mlp_beta_factor)
            blocks.append(ScaledPostNormBlock(mixer, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm,
                                              factors))
        return tuple(blocks)


MINIMAX = register_family(MiniMax())
