"""Kimi Delta Attention (kimi_linear, bailing_hybrid / Ling 3) on the mixer interface, over the model's own module.

Per head, state S [K, V]: S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t, with a
per-key-channel log decay g_t [K]; the transition of a span is a K x K matrix ("matrix" kind). Token-wise: the
q | k | v projections (pre-conv), the decay (the module's own `forget_gate`: Kimi's low-rank softplus gate or Ling's
bounded "safe" gate), the write strength b and the output gate (Kimi: low-rank `g_b_proj(g_a_proj(x))`, Ling:
`g_proj(x)`); one short causal conv + SiLU over all of q | k | v; the per-head gated RMS norm (`o_norm`, sigmoid
gate) and `o_proj`. The recurrence is `runtime/ops/kda` (chunked WY form; naive float32 reference beside it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.layers import activation, causal_depthwise_conv
from hypic_rag.runtime.mixers.base import DeltaRuleInputs, DeltaRuleMixer, ModuleConv, Projections, valid_steps
from hypic_rag.runtime.ops.kda import kda, kda_with_transition


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the models' l2norm)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _token_wise(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A module written for [B, T, hidden] inputs applied to tokens x [..., T, hidden] of any leading shape."""
    flat = module(x.reshape(1, -1, x.shape[-1]))
    return flat.reshape(*x.shape[:-1], *flat.shape[2:])


class KdaMixer(ModuleConv, DeltaRuleMixer):
    """Wraps `KimiLinearDeltaAttention` or `BailingHybridDeltaAttention`.

    state_shape (H, K, V) with K = V = the linear head dim; outputs [n, T, H, V]; projections: preconv
    [.., T, 3*H*K] (q | k | v), extras (log_decay [.., T, H, K] float32, b [.., T, H], output gate [.., T, H*K]).
    """

    recurrence = staticmethod(kda)
    with_transition = staticmethod(kda_with_transition)

    transition_kind = "matrix"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.activation = activation(module.activation)  # transformers applies `config.hidden_act` after the conv
        self.heads = int(module.num_heads)
        self.head_dim = int(module.head_dim)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.heads, self.head_dim, self.head_dim)

    def project(self, x: torch.Tensor) -> Projections:
        module = self.module
        preconv = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        log_decay = _token_wise(module.forget_gate, x).float()  # [.., T, H, K]
        if hasattr(module, "g_a_proj"):  # Kimi: low-rank output gate
            gate = module.g_b_proj(module.g_a_proj(x))
        else:  # Ling: full-rank output gate
            gate = module.g_proj(x)
        return Projections(preconv, (log_decay, module.b_proj(x), gate))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        conv = self.module.conv1d  # weight [C, 1, kernel]
        return self.activation(causal_depthwise_conv(preconv, context, conv.weight, conv.bias)).to(preconv.dtype)

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> DeltaRuleInputs:
        log_decay, b, _ = projections.extras
        runs, length, _ = convolved.shape
        query, key, value = (
            part.reshape(runs, length, self.heads, self.head_dim).float() for part in convolved.chunk(3, dim=-1)
        )
        query = _l2norm(query) * (self.head_dim**-0.5)
        key = _l2norm(key)
        beta = b.float().sigmoid()
        log_decay = log_decay.float()
        if lengths is not None:  # identity steps past each run's end: decay 1, write strength 0
            valid = valid_steps(lengths, length, convolved.device)
            beta = beta * valid[..., None]
            log_decay = log_decay * valid[..., None, None]
        return DeltaRuleInputs.from_time_major(query, key, value, log_decay, beta)

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Per-head RMS norm times sigmoid(output gate), then o_proj: core [..., T, H, V] -> [..., T, hidden]."""
        gate = projections.extras[2]
        *lead, heads, value_dim = core.shape
        normed = self.module.o_norm(core.to(dtype), gate.reshape(*lead, heads, value_dim))
        return self.module.o_proj(normed.reshape(*lead, heads * value_dim))
