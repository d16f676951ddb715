"""Full attention on the mixer interface: rotary positions and the q/k/v/o attention of the Qwen families.

`RotaryPositions` re-positions with the model's own rotary embedding (full or partial rotary, M-RoPE sections as
the module computes them; half-split rotation); `NoPositions` (in `base.py`) is NoPE. `ProjectedAttention` wraps a
transformers attention module with q_proj / k_proj / v_proj / o_proj, optional q_norm / k_norm and an optional
sigmoid output gate folded into q_proj (Qwen3.5 / Qwen3-Next): the shape most hybrid families share.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.fast_linear import LinearGroup
from hypic_rag.runtime.mixers.base import AttentionMixer, AttentionProjections, Positioner


class RotaryPositions(Positioner):
    """RoPE through the model's rotary embedding module: tables (cos, sin) [P, R], R <= head dim (partial
    rotary rotates the first R dims). `place` goes through `ops.rope` (the Triton kernel on CUDA)."""

    moves_keys = True

    def __init__(self, rotary_embedding: nn.Module) -> None:
        self.rotary_embedding = rotary_embedding

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return L.rotary_tables(self.rotary_embedding, positions, like)

    def apply(self, x: torch.Tensor, tables: Any, index: torch.Tensor | slice) -> torch.Tensor:
        cos, sin = tables
        return L.apply_rotary(x, cos[index], sin[index])

    def place(self, buffer: torch.Tensor, at: int, keys: torch.Tensor, tables: Any, position: int) -> None:
        cos, sin = tables
        L.rotate_into(buffer, at, keys, cos, sin, position)


class ProjectedAttention(AttentionMixer):
    """q/k/v/o attention over a transformers module (`module.head_dim`, `module.scaling`, `module.config`).

    q_norm / k_norm / o_proj default to the module's attributes of those names (LFM2 calls them q_layernorm,
    k_layernorm, out_proj: pass them). project: query [..., Hq, T, D], key / value [..., Hkv, T, D] (per-head
    norms applied when present), extras (gate [..., T, Hq*D],) when q_proj also emits the output gate, else ().
    """

    def __init__(
        self, module: nn.Module, positions: Positioner, num_heads: int | None = None, *,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, o_proj: nn.Module | None = None,
    ) -> None:
        self.module = module
        self.positions = positions
        self.scaling = float(module.scaling)
        self.num_heads = int(num_heads if num_heads is not None else module.config.num_attention_heads)
        self.head_dim = int(module.head_dim)
        self.q_norm = q_norm if q_norm is not None else getattr(module, "q_norm", None)
        self.k_norm = k_norm if k_norm is not None else getattr(module, "k_norm", None)
        self.o_proj = o_proj if o_proj is not None else module.o_proj
        # q, k and v read the same tokens: one product for a decode step's row (`LinearGroup`)
        self.qkv = LinearGroup([module.q_proj, module.k_proj, module.v_proj])

    def project(self, x: torch.Tensor) -> AttentionProjections:
        tokens, head_dim, heads = x.shape[:-1], self.head_dim, self.num_heads
        projected, key, value = self.qkv(x)
        extras: tuple[torch.Tensor, ...] = ()
        if projected.shape[-1] == heads * head_dim * 2:  # gated attention (Qwen3.5 / Qwen3-Next)
            query, gate = torch.chunk(projected.view(*tokens, heads, head_dim * 2), 2, dim=-1)
            extras = (gate.reshape(*tokens, -1),)
        else:
            query = projected.view(*tokens, heads, head_dim)
        key = key.reshape(*tokens, -1, head_dim)
        if self.q_norm is not None:
            query = self.q_norm(query)
        if self.k_norm is not None:
            key = self.k_norm(key)
        value = value.reshape(*tokens, -1, head_dim)
        return AttentionProjections(query.transpose(-3, -2), key.transpose(-3, -2), value.transpose(-3, -2), extras)

    def output(self, core: torch.Tensor, projections: AttentionProjections) -> torch.Tensor:
        if projections.extras:
            core = core * torch.sigmoid(projections.extras[0])
        return self.o_proj(core)
