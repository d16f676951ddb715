"""Mamba2 / SSD on the mixer interface, over the model's own module (granitemoehybrid; the attribute names are
those transformers' Mamba2-style mixers share: bamba, nemotron_h, zamba2 can reuse it where they match).

Per head, state S [N, P]: S_t = exp(dt_t a_h) S_{t-1} + dt_t b_t x_t^T, y_t = S_t^T c_t + d_h x_t; the transition
of a span is one number per head ("scalar" kind, P [H, 1, 1]). Token-wise: in_proj -> (gate z, conv input xBC,
raw dt); the short causal conv (with its activation) over xBC; the gated RMS norm and output projection. The
recurrence is `runtime/ops/ssd` (chunked torch form; naive float32 reference beside it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hypic_rag.runtime.layers import activation, causal_depthwise_conv
from hypic_rag.runtime.mixers.base import (
    HeadMajorInputs,
    HeadMajorMixer,
    ModuleConv,
    Projections,
    TransitionRun,
    valid_steps,
)
from hypic_rag.runtime.ops.ssd import ssd, ssd_with_transition
from hypic_rag.runtime.ops.time_step import softplus_time_step
from hypic_rag.runtime.segment_state import SegmentState


@dataclass(slots=True)
class SSDInputs(HeadMajorInputs):
    """x [n, H, T, P], dt [n, H, T] (0 on padded steps), b, c [n, G, T, N] (head-major, as `ops.ssd` takes them)."""

    x: torch.Tensor
    dt: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor


class Mamba2Mixer(ModuleConv, HeadMajorMixer):
    """Wraps a transformers Mamba2-style mixer module with `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`
    (gated RMS norm taking (y, z)), `out_proj`, `num_heads`, `head_dim`, `n_groups`, `ssm_state_size`,
    `intermediate_size`, `conv_dim`, `conv_kernel_size`, `activation`.

    time_step_limit: the (low, high) clamp of dt (the module's `time_step_limit` when None).
    state_shape (H, N, P); outputs [n, T, H, P]; projections: preconv xBC [.., T, conv_dim], extras (z [.., T, I],
    raw dt [.., T, H]).
    """

    transition_kind = "scalar"

    def __init__(self, module: nn.Module, time_step_limit: tuple[float, float] | None = None) -> None:
        self.module = module
        limit = time_step_limit if time_step_limit is not None else getattr(module, "time_step_limit", None)
        self.time_step_limit = None if limit is None else (float(limit[0]), float(limit[1]))
        self.activation = activation(module.activation)

    @property
    def state_shape(self) -> tuple[int, ...]:
        module = self.module
        return (int(module.num_heads), int(module.ssm_state_size), int(module.head_dim))

    def project(self, x: torch.Tensor) -> Projections:
        module = self.module
        gate, conv_input, raw_time_step = module.in_proj(x).split(
            [module.intermediate_size, module.conv_dim, module.num_heads], dim=-1
        )
        return Projections(conv_input, (gate, raw_time_step))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        conv = self.module.conv1d  # weight [C, 1, kernel]
        return self.activation(causal_depthwise_conv(preconv, context, conv.weight, conv.bias))

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> SSDInputs:
        module = self.module
        runs, length, _ = convolved.shape
        heads, groups, state_size = module.num_heads, module.n_groups, module.ssm_state_size
        x, b, c = torch.split(convolved, [module.intermediate_size, groups * state_size, groups * state_size], dim=-1)
        dt = softplus_time_step(projections.extras[1], module.dt_bias, self.time_step_limit)  # [n, T, H]
        if lengths is not None:  # identity steps past each run's end: dt = 0 leaves the state alone
            dt = dt * valid_steps(lengths, length, convolved.device)[..., None]
        return SSDInputs(
            x.reshape(runs, length, heads, module.head_dim).transpose(1, 2).float(),
            dt.transpose(1, 2).contiguous(),
            b.reshape(runs, length, groups, state_size).transpose(1, 2).float(),
            c.reshape(runs, length, groups, state_size).transpose(1, 2).float(),
        )

    def _decay_rates(self) -> torch.Tensor:
        return -torch.exp(self.module.A_log.float())

    def run(self, inputs: SSDInputs, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        output, final = ssd(inputs.x, inputs.dt, self._decay_rates(), inputs.b, inputs.c, self.module.D, start)
        return output.transpose(1, 2), final

    def run_with_transition(self, inputs: SSDInputs) -> TransitionRun:
        output, output_transition, transition, state = ssd_with_transition(
            inputs.x, inputs.dt, self._decay_rates(), inputs.b, inputs.c, self.module.D
        )
        segment = SegmentState(transition[..., None, None], state, "scalar")
        return TransitionRun(output.transpose(1, 2), output_transition, segment)

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Gated RMS norm (with the z gate) and output projection: core [..., T, H, P] -> [..., T, hidden]."""
        gate = projections.extras[0]
        scan_output = core.reshape(*core.shape[:-2], -1)
        return self.module.out_proj(self.module.norm(scan_output, gate).to(dtype))
