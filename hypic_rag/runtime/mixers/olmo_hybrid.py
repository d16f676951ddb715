"""OLMo-Hybrid's mixers on the interface: its Gated DeltaNet (separate projections, write strength in [0, 2]) and its
attention (q / k RMS norms over the whole projection, all heads jointly; RoPE only when the config sets a theta).

The linear layer is Gated DeltaNet exactly (`GatedDeltaNetMixer`'s conv, recurrence and transition): only the
projections (q_proj | k_proj | v_proj, a_proj, b_proj, g_proj), the doubled write strength
(`linear_allow_neg_eigval`: I - b k k^T then has eigenvalues in [-1, 1]) and the output path (RMS norm over V with
eps 1e-5 times silu(g), o_proj) differ.
"""

from __future__ import annotations

import torch

from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import AttentionProjections, Projections
from hypic_rag.runtime.mixers.gated_deltanet import GatedDeltaNetMixer


class OlmoGatedDeltaNetMixer(GatedDeltaNetMixer):
    """Wraps `OlmoHybridGatedDeltaNet`: state (Hv, K, V); projections: preconv [.., T, 2*Hk*K + Hv*V] (q | k | v),
    extras (g [.., T, Hv, V], b [.., T, Hv], a [.., T, Hv])."""

    def input_projection_names(self) -> tuple[str, ...]:
        return ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")

    def project(self, x: torch.Tensor) -> Projections:
        query, key, value, gate, b, a = self.input_projections(x)
        preconv = torch.cat([query, key, value], dim=-1)
        return Projections(preconv, (gate.reshape(*x.shape[:-1], -1, self.module.head_v_dim), b, a))

    def write_strength(self, b: torch.Tensor) -> torch.Tensor:
        beta = super().write_strength(b)
        return beta * 2.0 if self.module.allow_neg_eigval else beta  # b = 2 sigmoid(.) in [0, 2]

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """RMS norm over V times silu(g), then o_proj: core [..., T, Hv, V] -> [..., T, hidden]."""
        gate = projections.extras[0]
        *lead, heads, value_dim = core.shape
        normed = self.module.o_norm(core.reshape(-1, value_dim).to(dtype), gate.reshape(-1, value_dim))
        return self.module.o_proj(normed.reshape(*lead, heads * value_dim))


class WholeNormAttention(ProjectedAttention):
    """`OlmoHybridAttention`: q_norm / k_norm normalise the whole projection [.., T, H*D] before it is split into
    heads; no output gate."""

    def project(self, x: torch.Tensor) -> AttentionProjections:
        module, tokens, head_dim = self.module, x.shape[:-1], self.head_dim
        query, key, value = self.qkv(x)
        query = module.q_norm(query).reshape(*tokens, -1, head_dim)
        key = module.k_norm(key).reshape(*tokens, -1, head_dim)
        value = value.reshape(*tokens, -1, head_dim)
        return AttentionProjections(query.transpose(-3, -2), key.transpose(-3, -2), value.transpose(-3, -2))
