"""Zamba2's shared attention on the mixer interface (docs/families_ssm.md, section 2, zamba2).

The attention weights are shared by every hybrid layer of one memory block, but each hybrid layer adds its own
low-rank adapters to q / k / v (`use_shared_attention_adapter`) and caches its own keys and values, so a mixer is
built per hybrid layer: `SharedAttention(module, positions, adapter_index)`. Input width 2h (the block concatenates
the hidden states with the token embeddings), head dim 2h / heads, softmax scale (head_dim / 2)^-1/2 (the module's
`scaling`); RoPE over the whole head only with `use_mem_rope`, else NoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from hypic_rag.runtime.mixers.base import (
    AttentionMixer,
    AttentionProjections,
    Positioner,
)


class SharedAttention(AttentionMixer):
    """A `Zamba2Attention` seen from one hybrid layer: `adapter_index` picks the layer's adapters (its rank among
    the hybrid layers). project: query [..., H, T, D], key / value [..., Hkv, T, D] (before any position)."""

    def __init__(self, module: nn.Module, positions: Positioner, adapter_index: int) -> None:
        self.module = module
        self.positions = positions
        self.scaling = float(module.scaling)
        self.head_dim = int(module.head_dim)
        self.adapter_index = adapter_index
        self.adapted = bool(module.config.use_shared_attention_adapter)

    def _projected(self, x: torch.Tensor, projection: str) -> torch.Tensor:
        """projection(x) plus this layer's adapter, as heads [..., H, T, D]."""
        module = self.module
        out = getattr(module, f"{projection}_proj")(x)
        if self.adapted:
            out = out + getattr(module, f"linear_{projection}_adapter_list")[self.adapter_index](x)
        return out.view(*x.shape[:-1], -1, self.head_dim).transpose(-3, -2)

    def project(self, x: torch.Tensor) -> AttentionProjections:
        return AttentionProjections(self._projected(x, "q"), self._projected(x, "k"), self._projected(x, "v"))

    def output(self, core: torch.Tensor, projections: AttentionProjections) -> torch.Tensor:
        return self.module.o_proj(core)
