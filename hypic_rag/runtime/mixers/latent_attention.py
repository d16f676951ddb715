"""Multi-head latent attention (MLA: kimi_linear, bailing_hybrid) on the mixer interface, in its absorbed form.

transformers' MLA expands each token's compressed latent c [R] (RMS-normed `kv_a_proj_with_mqa` output) into
per-head keys [k_nope_h = W_uk_h c | k_rope] and values v_h = W_uv_h c, with k_rope [E] one vector shared by all
heads. Scores and outputs are linear in c, so the up-projections can move to the query and output sides:
    q_h . k_h = (W_uk_h^T q_nope_h) . c + q_rope_h . k_rope,      o_h = W_uv_h (sum_j p_hj c_j).
That is multi-query attention with ONE key head [c | k_rope] (R + E dims) and one value head c (R dims), which is
what the runtime caches per token (R + E + R values instead of H * (nope + E + V) expanded ones; Kimi-Linear:
1088 vs 10240) and what the shared causal core computes. Only the trailing E key dims carry a position: Kimi's MLA
has none (`NoPositions`); Ling rotates them with interleaved-pair RoPE (`InterleavedTailRotary`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hypic_rag.runtime import layers as L
from hypic_rag.runtime.mixers.base import AttentionMixer, AttentionProjections, Positioner


class InterleavedTailRotary(Positioner):
    """RoPE on the last `rotary_dim` dims of queries and keys, DeepSeek's interleaved layout: pairs (x0, x1),
    (x2, x3), ... each rotated by one frequency, written de-interleaved ([rotated evens | rotated odds]) as
    transformers' `apply_rotary_pos_emb_interleave` does. Tables: (cos, sin) [P, rotary_dim / 2] from the model's
    rotary module (whose own tables are cat(freqs, freqs))."""

    moves_keys = True

    def __init__(self, rotary_embedding: nn.Module, rotary_dim: int) -> None:
        self.rotary_embedding = rotary_embedding
        self.rotary_dim = int(rotary_dim)

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = L.rotary_tables(self.rotary_embedding, positions, like)
        half = cos.shape[-1] // 2
        return cos[..., :half], sin[..., :half]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, D] with its last rotary_dim dims rotated by cos, sin [T, rotary_dim / 2]."""
        passed, rotated = x[..., : -self.rotary_dim], x[..., -self.rotary_dim :]
        even, odd = rotated[..., 0::2], rotated[..., 1::2]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return torch.cat([passed, even * cos - odd * sin, odd * cos + even * sin], dim=-1)

    def apply(self, x: torch.Tensor, tables: Any, index: torch.Tensor | slice) -> torch.Tensor:
        cos, sin = tables
        return self._rotate(x, cos[index], sin[index])

    def place(self, buffer: torch.Tensor, at: int, keys: torch.Tensor, tables: Any, position: int) -> None:
        cos, sin = tables
        length = keys.shape[1]
        keys = keys.to(device=buffer.device, dtype=buffer.dtype)
        span = slice(position, position + length)
        buffer[:, at : at + length] = self._rotate(keys, cos[span], sin[span])


class LatentAttention(AttentionMixer):
    """Absorbed MLA over `KimiLinearAttention` / `BailingHybridAttention` (q_proj or q_a/q_b with its norm,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; Ling's per-head output gate `g_proj`).

    project: query [..., H, T, R + E] (absorbed nope part | rope part), key [..., 1, T, R + E] (normed latent |
    shared rope part, before any position), value [..., 1, T, R] (the normed latent); extras (gate [..., T, H],)
    for Ling, else (). output: core [..., T, H * R] -> W_uv per head -> (gate) -> o_proj.
    """

    def __init__(self, module: nn.Module, positions: Positioner) -> None:
        self.module = module
        self.positions = positions
        self.scaling = float(module.scaling)
        self.heads = int(module.num_heads)
        self.nope_dim = int(module.qk_nope_head_dim)
        self.rope_dim = int(module.qk_rope_head_dim)
        self.value_dim = int(module.v_head_dim)
        self.latent_dim = int(module.kv_lora_rank)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, R] and W_uv [H, V, R] (views of kv_b_proj's weight)."""
        weight = self.module.kv_b_proj.weight.view(self.heads, self.nope_dim + self.value_dim, self.latent_dim)
        return weight[:, : self.nope_dim], weight[:, self.nope_dim :]

    def project(self, x: torch.Tensor) -> AttentionProjections:
        module = self.module
        if module.q_proj is not None:
            query = module.q_proj(x)
        else:
            query = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(x)))
        query = query.view(*x.shape[:-1], self.heads, self.nope_dim + self.rope_dim)
        query_nope, query_rope = query.split([self.nope_dim, self.rope_dim], dim=-1)
        key_up, _ = self._up_projections()
        absorbed = torch.einsum("...thn,hnr->...htr", query_nope, key_up)  # [..., H, T, R]
        query = torch.cat([absorbed, query_rope.transpose(-3, -2)], dim=-1)
        latent, key_rope = module.kv_a_proj_with_mqa(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = module.kv_a_layernorm(latent)
        key = torch.cat([latent, key_rope], dim=-1).unsqueeze(-3)  # [..., 1, T, R + E]
        extras = (module.g_proj(x),) if getattr(module, "g_proj", None) is not None else ()
        return AttentionProjections(query, key, latent.unsqueeze(-3), extras)

    def output(self, core: torch.Tensor, projections: AttentionProjections) -> torch.Tensor:
        _, value_up = self._up_projections()
        core = core.view(*core.shape[:-1], self.heads, self.latent_dim)
        out = torch.einsum("...thr,hvr->...thv", core, value_up)  # [..., T, H, V]
        if projections.extras:  # Ling: a sigmoid gate per head
            out = out * torch.sigmoid(projections.extras[0].float()).to(out.dtype)[..., None]
        return self.module.o_proj(out.reshape(*out.shape[:-2], self.heads * self.value_dim))
