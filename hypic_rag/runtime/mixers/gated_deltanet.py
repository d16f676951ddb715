"""Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the mixer interface, over the model's own module.

Per value head, state S [K, V]: S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t; the
transition of a span is a K x K matrix ("matrix" kind). Token-wise: the q/k/v (pre-conv), z (output gate), b and a
projections; the short causal conv (with its activation, the module's `activation`: the config's `hidden_act`) over the
q/k/v channels; the gated RMS norm and output projection.
The recurrence is `runtime/ops/gated_delta_rule` (chunked WY form, fla on CUDA; naive reference beside it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.fast_linear import LinearGroup
from hypic_rag.runtime.layers import activation, causal_depthwise_conv
from hypic_rag.runtime.mixers.base import DeltaRuleInputs, DeltaRuleMixer, ModuleConv, Projections, valid_steps
from hypic_rag.runtime.ops.gated_delta_rule import gated_delta_rule, gated_delta_rule_with_transition
from hypic_rag.runtime.ops.gated_delta_rule.chunk import BetweenRuns, chunk_gated_delta_rule_packed
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import gated_delta_rule_step

FUSED_STEP = True
"""Whether a CPU decode step runs `GatedDeltaNetMixer.step`'s own short form (the conv window as one product, q and
k normalised together, the one-token recurrence `gated_delta_rule_step`). False: the
generic step over runs of one token (`RecurrentMixer.step`, the reference the tests compare with); CUDA always
takes the generic step (fla's kernels)."""


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNetMixer(ModuleConv, DeltaRuleMixer):
    """Wraps a transformers Gated DeltaNet module (`Qwen3_5GatedDeltaNet`, `Qwen3NextGatedDeltaNet`, ...).

    state_shape (H, K, V) with H the value heads; outputs [n, T, H, V]; projections: preconv [.., T, C] (q|k|v),
    extras (z [.., T, H, V], b [.., T, H], a [.., T, H]).
    """

    recurrence = staticmethod(gated_delta_rule)
    with_transition = staticmethod(gated_delta_rule_with_transition)

    transition_kind = "matrix"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.activation = activation(module.activation)  # transformers applies `config.hidden_act` after the conv
        # the input projections read the same tokens: one product for a decode step's row (`LinearGroup`)
        self.input_projections = LinearGroup([getattr(module, name) for name in self.input_projection_names()])

    def input_projection_names(self) -> tuple[str, ...]:
        """The module's input projections, in the order `project` takes them from `input_projections`."""
        if hasattr(self.module, "in_proj_qkvz"):  # Qwen3-Next
            return ("in_proj_qkvz", "in_proj_ba")
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def write_strength(self, b: torch.Tensor) -> torch.Tensor:
        """beta [..., H] float32 from the b projection: sigmoid(b)."""
        return b.float().sigmoid()

    @property
    def state_shape(self) -> tuple[int, ...]:
        module = self.module
        return (int(module.num_v_heads), int(module.head_k_dim), int(module.head_v_dim))

    def project(self, x: torch.Tensor) -> Projections:
        module = self.module
        if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: grouped qkvz / ba layout (its own code wants 3 dims)
            batched = x if x.dim() == 3 else x[None]
            query, key, value, z, b, a = module.fix_query_key_value_ordering(*self.input_projections(batched))
            preconv = torch.cat([t.reshape(*t.shape[:2], -1) for t in (query, key, value)], dim=-1)
            if x.dim() != 3:
                preconv, z, b, a = preconv[0], z[0], b[0], a[0]
            return Projections(preconv, (z, b, a))
        preconv, z, b, a = self.input_projections(x)
        return Projections(preconv, (z.reshape(*x.shape[:-1], -1, module.head_v_dim), b, a))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        conv = self.module.conv1d  # weight [C, 1, kernel]
        return self.activation(causal_depthwise_conv(preconv, context, conv.weight, conv.bias))

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> DeltaRuleInputs:
        module = self.module
        _, b, a = projections.extras
        runs, length, _ = convolved.shape
        query, key, value = torch.split(convolved, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        heads_v, heads_k = module.num_v_heads, module.num_k_heads
        query = query.reshape(runs, length, heads_k, module.head_k_dim).float()
        key = key.reshape(runs, length, heads_k, module.head_k_dim).float()
        value = value.reshape(runs, length, heads_v, module.head_v_dim).float()
        if heads_v != heads_k:
            query = query.repeat_interleave(heads_v // heads_k, dim=2)
            key = key.repeat_interleave(heads_v // heads_k, dim=2)
        query = _l2norm(query) * (module.head_k_dim**-0.5)
        key = _l2norm(key)
        beta = self.write_strength(b)
        log_decay = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        if lengths is not None:  # identity steps past each run's end: decay 1, write strength 0
            valid = valid_steps(lengths, length, convolved.device)
            beta = beta * valid[..., None]
            log_decay = log_decay * valid[..., None]
        return DeltaRuleInputs.from_time_major(query, key, value, log_decay, beta)

    def step(
        self, projections: Projections, tails: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of n sequences (contract: `RecurrentMixer.step`): preconv [n, C], z [n, H, V], b, a
        [n, H]; tails [n, C, kernel-1]; starts [n, H, K, V]. On CPU with `FUSED_STEP`, in few operations: the conv
        window (tail and token) times the taps summed, q and k l2-normalised as one tensor, the gates, and
        `gated_delta_rule_step`; the same values as the generic step (float32 round-off)."""
        preconv = projections.preconv
        if not FUSED_STEP or preconv.is_cuda or tails.shape[-1] == 0:
            return super().step(projections, tails, starts)
        module = self.module
        conv = module.conv1d  # weight [C, 1, kernel]
        batch = preconv.shape[0]
        window = torch.cat([tails.to(conv.weight.dtype), preconv[:, :, None].to(conv.weight.dtype)], dim=2)
        mixed = (window * conv.weight[:, 0]).sum(dim=-1)  # [n, C]
        if conv.bias is not None:
            mixed = mixed + conv.bias
        mixed = self.activation(mixed).float()
        key_heads, key_dim = module.num_k_heads, module.head_k_dim
        both = mixed[:, : 2 * module.key_dim].reshape(batch, 2 * key_heads, key_dim)
        both = _l2norm(both)
        query = both[:, :key_heads] * (key_dim**-0.5)
        value = mixed[:, 2 * module.key_dim :].reshape(batch, module.num_v_heads, module.head_v_dim)
        _, b, a = projections.extras
        log_decay = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        key = both[:, key_heads:]
        outputs, finals = gated_delta_rule_step(query, key, value, log_decay, self.write_strength(b), starts)
        return outputs, window[:, :, 1:].float(), finals

    @property
    def scans_runs(self) -> bool:  # type: ignore[override]
        """On CPU one chunked scan over all runs (`chunk_gated_delta_rule_packed`) beats the identity-start batch;
        on CUDA fla's kernels run the batch, so the stack keeps that path there."""
        return not next(self.module.parameters()).is_cuda

    def run_packed(
        self, inputs: DeltaRuleInputs, lengths: list[int], start: torch.Tensor, before_run: BetweenRuns | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed runs of one sequence in one chunked scan (`chunk_gated_delta_rule_packed`): outputs [1, T, H, V]."""
        outputs, final = chunk_gated_delta_rule_packed(*inputs.as_tuple(), lengths, start, before_run)
        return outputs.transpose(1, 2), final

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Gated RMS norm and output projection: core [..., T, H, V] -> [..., T, hidden]."""
        z = projections.extras[0]
        *lead, heads, value_dim = core.shape
        normed = self.module.norm(core.reshape(-1, value_dim).to(dtype), z.reshape(-1, value_dim))
        return self.module.out_proj(normed.reshape(*lead, heads * value_dim))
