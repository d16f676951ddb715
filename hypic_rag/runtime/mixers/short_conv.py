"""LFM2's gated short convolution on the mixer interface: a recurrent mixer WITHOUT a recurrent state.

y = out_proj(C * conv(B * x)) with (B, C, x) = in_proj(u) split in three and a depthwise causal conv (no
activation). Its whole context is the conv tail (kernel-1 past inputs B * x), so `transition_kind` is None: an entry
holds only the tail, composition has nothing to apply, and every run is independent (`run` is the identity on the
convolved channels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hypic_rag.runtime.layers import causal_depthwise_conv
from hypic_rag.runtime.mixers.base import Projections, RecurrenceInputs, RecurrentMixer, TransitionRun


@dataclass(slots=True)
class ConvolvedInputs(RecurrenceInputs):
    """The convolved channels [n, T, C] (token-major): the mixer's outputs before the C gate."""

    convolved: torch.Tensor

    def select(self, rows: slice, start: int, stop: int) -> ConvolvedInputs:
        return ConvolvedInputs(self.convolved[rows, start:stop])


class ShortConvMixer(RecurrentMixer):
    """Wraps `Lfm2ShortConv` (`in_proj`, `conv`, `out_proj`, `conv_kernel_size`). Outputs [n, T, hidden];
    projections: preconv B * x [.., T, hidden], extras (C [.., T, hidden],)."""

    transition_kind = None

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def conv_channels(self) -> int:
        return int(self.module.conv.in_channels)

    @property
    def conv_width(self) -> int:
        return int(self.module.conv_kernel_size) - 1

    @property
    def state_shape(self) -> tuple[int, ...]:
        return ()

    def project(self, x: torch.Tensor) -> Projections:
        b, c, value = self.module.in_proj(x).chunk(3, dim=-1)
        return Projections(b * value, (c,))

    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        conv = self.module.conv  # weight [C, 1, kernel]
        return causal_depthwise_conv(preconv, context, conv.weight, conv.bias)

    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> ConvolvedInputs:
        return ConvolvedInputs(convolved)

    def run(self, inputs: ConvolvedInputs, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        runs = inputs.convolved.shape[0]
        return inputs.convolved, inputs.convolved.new_zeros(runs, 0)

    def run_with_transition(self, inputs: ConvolvedInputs) -> TransitionRun:
        raise NotImplementedError("a short convolution has no recurrent state, hence no transition")

    def outputs_from_start(self, zero_outputs: torch.Tensor, transition_outputs, start: torch.Tensor) -> torch.Tensor:
        return zero_outputs

    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        return self.module.out_proj((projections.extras[0] * core).to(dtype))
