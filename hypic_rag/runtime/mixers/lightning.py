"""MiniMax lightning attention on the mixer interface, over the model's own module.

Per head, state S [D, D]: S_t = exp(-s_h) S_{t-1} + k_t v_t^T, o_t = S_t^T q_t, with one constant decay rate s_h per
head and layer (the module's `slope_rate` buffer); the transition of a span of L tokens is the scalar exp(-s_h L)
per head ("scalar" kind: P [H, 1, 1]). Token-wise: silu(qkv_proj(x)) laid out per head as q | k | v (D each; no
normalisation, no scaling) and the output gate; no conv (the entry's conv tail is empty); output: one RMS norm over
all H*D channels, times sigmoid(output_gate(x)), out_proj. The recurrence is `runtime/ops/lightning` (chunked form;
naive float32 reference beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hypic_rag.runtime.mixers.base import HeadMajorInputs, HeadMajorMixer, Projections, TransitionRun, valid_steps
from hypic_rag.runtime.ops.lightning import lightning_attention, lightning_with_transition
from hypic_rag.runtime.segment_state import SegmentState


@dataclass(slots=True)
class LightningInputs(HeadMajorInputs):
    """query, key, value [n, H, T, D] (head-major), log_decay [n, H, T] (-s_h; 0 on identity steps)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    log_decay: torch.Tensor


class LightningMixer(HeadMajorMixer):
    """Wraps `MiniMaxLightningAttention`: state (H, D, D); outputs [n, T, H, D]; projections: preconv [.., T, 0] (no
    conv), extras (qkv [.., T, 3*H*D] after SiLU, output gate logits [.., T, H*D])."""

    transition_kind = "scalar"

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.heads = int(module.num_attention_heads)
        self.head_dim = int(module.head_dim)

    @property
    def conv_channels(self) -> int:
        return 0

    @property
    def conv_width(self) -> int:
        return 0

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.heads, self.head_dim, self.head_dim)

    def project(self, x: torch.Tensor) -> Projections:
        module = self.module
        qkv = module.act_fn(module.qkv_proj(x))
        return Projections(x.new_zeros(*x.shape[:-1], 0), (qkv, module.output_gate(x)))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return preconv

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> LightningInputs:
        qkv = projections.extras[0]
        runs, length = qkv.shape[:2]
        query, key, value = qkv.float().view(runs, length, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        slopes = self.module.slope_rate.float().reshape(1, self.heads, 1).to(qkv.device)
        log_decay = (-slopes).expand(runs, self.heads, length)
        if lengths is not None:  # identity steps past each run's end: decay 1, nothing written
            valid = valid_steps(lengths, length, qkv.device)
            log_decay = log_decay * valid[:, None, :]
            key = key * valid[..., None, None]
        return LightningInputs(
            query.transpose(1, 2).contiguous(),
            key.transpose(1, 2).contiguous(),
            value.transpose(1, 2).contiguous(),
            log_decay.contiguous(),
        )

    def run(self, inputs: LightningInputs, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        output, final = lightning_attention(*inputs.as_tuple(), start)
        return output.transpose(1, 2), final

    def run_with_transition(self, inputs: LightningInputs) -> TransitionRun:
        zero_outputs, start_weight, span = lightning_with_transition(*inputs.as_tuple())
        segment = SegmentState(span.decay[..., None, None], span.state, "scalar")
        # what a start state adds to output t: exp(gamma_t) S_0^T q_t, i.e. (exp(gamma_t) q_t) @ S_0
        return TransitionRun(zero_outputs.transpose(1, 2), start_weight[..., None] * inputs.query, segment)

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """RMS norm over all H*D channels, times sigmoid(output gate), out_proj: [..., T, H, D] -> [..., T, hidden]."""
        gate = projections.extras[1]
        normed = self.module.norm(core.reshape(*core.shape[:-2], self.heads * self.head_dim).to(dtype))
        return self.module.out_proj(torch.sigmoid(gate) * normed)
