"""Ling 3 (`bailing_hybrid`): Kimi-Linear's layout (KDA linear layers, MLA attention, pre-norm blocks, dense then
MoE MLPs) with a bounded KDA gate, a per-head output gate on MLA and interleaved RoPE on MLA's shared key part."""

from __future__ import annotations

from torch import nn

from hypic_rag.runtime.families.base import register_family
from hypic_rag.runtime.families.kimi_linear import KimiLinear
from hypic_rag.runtime.mixers.base import Positioner
from hypic_rag.runtime.mixers.latent_attention import InterleavedTailRotary


class BailingHybrid(KimiLinear):
    """As `KimiLinear`; MLA's last `qk_rope_head_dim` query / key dims carry interleaved-pair RoPE."""

    model_types = ("bailing_hybrid",)
    needs_rotary_embedding = True

    def positions(self, hf_model: nn.Module) -> Positioner:
        return InterleavedTailRotary(self.backbone(hf_model).rotary_emb, hf_model.config.qk_rope_head_dim)


BAILING_HYBRID = register_family(BailingHybrid())
