"""Mamba1 (selective scan, jamba) on the mixer interface, over the model's own module.

Per channel d and state entry n: S_t[d, n] = exp(dt_t[d] a[d, n]) S_{t-1}[d, n] + dt_t[d] x_t[d] b_t[n],
y_t[d] = sum_n S_t[d, n] c_t[n] + D[d] x_t[d]; every state entry decays at its own rate, so a span's transition is
ELEMENTWISE and shaped like the state [D, N] ("vector" kind). Token-wise: in_proj -> (x, gate z); the short causal
conv (with its activation) over x; after the conv, x_proj -> (raw dt, b, c) with RMS norms on each, dt_proj and the
softplus; out_proj(y * silu(z)). The recurrence is `runtime/ops/selective_scan` (step path on CPU, blocked scan on
CUDA; naive float32 reference beside them). docs/families_ssm.md, section 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime.layers import causal_depthwise_conv
from hypic_rag.runtime.mixers.base import (
    Projections,
    RecurrenceInputs,
    RecurrentMixer,
    TransitionRun,
    valid_steps,
)
from hypic_rag.runtime.ops.selective_scan import (
    selective_scan,
    selective_scan_start_output,
    selective_scan_with_transition,
)
from hypic_rag.runtime.ops.time_step import softplus_time_step
from hypic_rag.runtime.segment_state import SegmentState


@dataclass(slots=True)
class SelectiveScanInputs(RecurrenceInputs):
    """x, dt [n, D, T] (channel-major, dt 0 on padded steps), b, c [n, T, N] (as `ops.selective_scan` takes them)."""

    x: torch.Tensor
    dt: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    def select(self, rows: slice, start: int, stop: int) -> SelectiveScanInputs:
        return SelectiveScanInputs(
            self.x[rows, :, start:stop], self.dt[rows, :, start:stop], self.b[rows, start:stop], self.c[rows, start:stop]
        )


class Mamba1Mixer(RecurrentMixer):
    """Wraps a transformers Mamba1 mixer with data-dependent b/c/dt norms (`JambaMambaMixer`): `in_proj`, `conv1d`,
    `act`, `x_proj`, `dt_layernorm`, `b_layernorm`, `c_layernorm`, `dt_proj`, `A_log` [D, N], `D` [D], `out_proj`,
    `intermediate_size`, `ssm_state_size`, `time_step_rank`, `conv_kernel_size`.

    state_shape (D, N); transition P [D, N] ("vector", the state's own shape); outputs [n, T, D]; projections:
    preconv x [.., T, D], extras (gate z [.., T, D],); transition_outputs (cumulative dt [n, D, T], c [n, T, N]).
    """

    transition_kind = "vector"

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def conv_channels(self) -> int:
        return int(self.module.intermediate_size)

    @property
    def conv_width(self) -> int:
        return int(self.module.conv_kernel_size) - 1

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (int(self.module.intermediate_size), int(self.module.ssm_state_size))

    def project(self, x: torch.Tensor) -> Projections:
        conv_input, gate = self.module.in_proj(x).chunk(2, dim=-1)
        return Projections(conv_input, (gate,))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        conv = self.module.conv1d  # weight [C, 1, kernel]
        return self.module.act(causal_depthwise_conv(preconv, context, conv.weight, conv.bias))

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> SelectiveScanInputs:
        module = self.module
        length = convolved.shape[1]
        rank, state_size = module.time_step_rank, module.ssm_state_size
        raw_dt, b, c = module.x_proj(convolved).split([rank, state_size, state_size], dim=-1)
        raw_dt = module.dt_layernorm(raw_dt) @ module.dt_proj.weight.T  # [n, T, D]; the bias goes in the softplus
        dt = softplus_time_step(raw_dt, module.dt_proj.bias)  # no clamp in Mamba1
        if lengths is not None:  # identity steps past each run's end: dt = 0 leaves the state alone
            dt = dt * valid_steps(lengths, length, convolved.device)[..., None]
        return SelectiveScanInputs(
            convolved.transpose(1, 2).float(),
            dt.transpose(1, 2).contiguous(),
            module.b_layernorm(b).float(),
            module.c_layernorm(c).float(),
        )

    def _decay_rates(self) -> torch.Tensor:
        return -torch.exp(self.module.A_log.float())

    def run(
        self, inputs: SelectiveScanInputs, start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output, final = selective_scan(inputs.x, inputs.dt, self._decay_rates(), inputs.b, inputs.c, self.module.D, start)
        return output.transpose(1, 2), final

    def run_with_transition(self, inputs: SelectiveScanInputs) -> TransitionRun:
        output, cumulative_dt, transition, state = selective_scan_with_transition(
            inputs.x, inputs.dt, self._decay_rates(), inputs.b, inputs.c, self.module.D
        )
        return TransitionRun(output.transpose(1, 2), (cumulative_dt, inputs.c), SegmentState(transition, state, "vector"))

    def outputs_from_start(
        self, zero_outputs: torch.Tensor, transition_outputs: torch.Tensor | tuple[torch.Tensor, ...],
        start: torch.Tensor,
    ) -> torch.Tensor:
        """zero_outputs [n, T, D], transition_outputs (cumulative dt [n, D, T], c [n, T, N]), start [n, D, N]."""
        cumulative_dt, c = transition_outputs
        added = selective_scan_start_output(cumulative_dt, self._decay_rates(), c, start)  # [n, D, T]
        return zero_outputs + added.transpose(1, 2)

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Gate and output projection: core [..., T, D] -> out_proj(core * silu(z)) [..., T, hidden]."""
        gate = projections.extras[0]
        return self.module.out_proj((core * F.silu(gate.float())).to(dtype))
