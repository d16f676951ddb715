"""The one mixer interface: what a family implements once so that the stack, the encoder, the entry format, the
cache, composition, seams and decode work for it unchanged (docs/runtime.md, "Mixers").

Two kinds of token mixer sit in a hybrid block:
- `RecurrentMixer` (linear attention / SSM / short conv): token-wise projections, a short causal conv with an
  explicit left context (the conv tail), a recurrence from a given start state that returns its outputs and end
  state and, on request, the span's affine map (`SegmentState` of the mixer's `transition_kind`), and the
  token-wise output path.
- `AttentionMixer` (full attention): token-wise q/k/v (keys before any position is applied), a `Positioner`
  saying how cached keys are re-positioned (RoPE, partial RoPE, M-RoPE; or none: NoPE, MLA without RoPE), the
  scaled-dot-product core (shared, in `layers.py`) and the output path.

Conventions: token-wise methods take flat tokens [..., T, hidden] (any leading batch dims, so a later pass can run
them over many requests' tokens at once). Recurrence methods take n runs padded to a common length at their end
([n, T, ...]); padded steps must be identity steps (they leave the state alone). Outputs of a recurrence are
token-major [n, T, *output_shape]. States are float32 [n, *state_shape].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from hypic_rag.runtime.segment_state import SegmentState, transition_shape

InputsT = TypeVar("InputsT", bound="RecurrenceInputs")


@dataclass(slots=True)
class Projections:
    """Token-wise projections of tokens x [..., T, hidden]: preconv [..., T, C] (the conv's inputs; C =
    `conv_channels`) and any other token-wise tensors the mixer needs later (gates, decays, output gates), each
    [..., T, ...] with the same leading dims as x (so the stack can gather runs of tokens from all of them)."""

    preconv: torch.Tensor
    extras: tuple[torch.Tensor, ...] = ()

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> Projections:
        """Projections with `function` applied to every tensor."""
        return Projections(function(self.preconv), tuple(function(extra) for extra in self.extras))


class RecurrenceInputs(ABC):
    """A recurrent mixer's inputs for n runs of T steps (after conv and gates); opaque to the stack."""

    @abstractmethod
    def select(self: InputsT, rows: slice, start: int, stop: int) -> InputsT:
        """Runs `rows`, steps start..stop-1 (views where possible)."""


@dataclass(slots=True)
class HeadMajorInputs(RecurrenceInputs):
    """Inputs whose tensors all hold the runs on dim 0 and the steps on dim 2 ([n, H, T, ...], as the head-major ops
    take them); subclasses declare the tensors as fields, in the order the op takes them."""

    @classmethod
    def from_time_major(cls: type[InputsT], *tensors: torch.Tensor) -> InputsT:
        """From time-major tensors [n, T, H, ...], made head-major and contiguous."""
        return cls(*(tensor.transpose(1, 2).contiguous() for tensor in tensors))

    def select(self: InputsT, rows: slice, start: int, stop: int) -> InputsT:
        return type(self)(*(tensor[rows, :, start:stop] for tensor in self.as_tuple()))

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, field.name) for field in fields(self))


@dataclass(slots=True)
class DeltaRuleInputs(HeadMajorInputs):
    """The delta rules' inputs (Gated DeltaNet, KDA): query, key [n, H, T, K] (l2-normalised, query scaled by
    K^-1/2), value [n, H, T, V], log_decay [n, H, T] (Gated DeltaNet) or [n, H, T, K] (KDA), beta [n, H, T]."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    log_decay: torch.Tensor
    beta: torch.Tensor


@dataclass(slots=True)
class TransitionRun:
    """A span run from the identity start: zero_outputs [n, T, *output_shape] (outputs from S_0 = 0);
    transition_outputs: what `RecurrentMixer.outputs_from_start` needs to add a start state's contribution, in the
    mixer's own layout, a tensor or a tuple of tensors with the runs along dim 0 (Gated DeltaNet / SSD: P_t^T q_t
    [n, H, T, K]; Mamba1 may keep (C, cumulative dt)); segment: the span's affine map, transition [n, ...] and
    state [n, *state_shape]."""

    zero_outputs: torch.Tensor
    transition_outputs: torch.Tensor | tuple[torch.Tensor, ...]
    segment: SegmentState

    def select(self, rows: slice) -> TransitionRun:
        """The runs `rows` of every part."""
        outputs = self.transition_outputs
        selected = tuple(t[rows] for t in outputs) if isinstance(outputs, tuple) else outputs[rows]
        return TransitionRun(self.zero_outputs[rows], selected, self.segment.select(rows))

def valid_steps(lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """[n, T] float mask, 1 for the steps of run i below lengths[i] and 0 past its end: what every recurrent mixer
    multiplies into its write strength / time step / decay so that the padded steps of a batch of runs are identity
    steps (the `recurrence_inputs` contract)."""
    steps = torch.arange(length, device=device)[None, :]
    return (steps < torch.tensor(lengths, device=device)[:, None]).float()


class RecurrentMixer(ABC):
    """A linear-attention / SSM / short-conv mixer (see the module docstring).

    Subclasses set `transition_kind` ("matrix", "vector", "scalar"; None for a mixer without a recurrent state,
    e.g. LFM2's short convolution, whose entry then holds only its conv tail) and, for "vector", `vector_shape`.
    """

    transition_kind: str | None = "matrix"

    @property
    @abstractmethod
    def conv_channels(self) -> int:
        """C: channels of the short conv (0 without one)."""

    @property
    @abstractmethod
    def conv_width(self) -> int:
        """kernel - 1: how many past conv inputs the conv tail keeps (0 without a conv or with kernel 1)."""

    @property
    @abstractmethod
    def state_shape(self) -> tuple[int, ...]:
        """The recurrent state of one sequence, e.g. (H, K, V); () when `transition_kind` is None."""

    @property
    def vector_shape(self) -> tuple[int, ...] | None:
        """The transition's shape for the "vector" kind (broadcastable to `state_shape`); None: the state's."""
        return None

    @property
    def transition_shape(self) -> tuple[int, ...]:
        """The shape of one span's transition P (what the entry stores as `transition`)."""
        if self.transition_kind is None:
            return ()
        return transition_shape(self.transition_kind, self.state_shape, self.vector_shape)

    def empty_conv_tail(self, device: torch.device) -> torch.Tensor:
        """Zero conv context [C, kernel-1] (what a standalone span sees), float32."""
        return torch.zeros(self.conv_channels, self.conv_width, dtype=torch.float32, device=device)

    def zero_state(self, device: torch.device) -> torch.Tensor:
        """Zero recurrent state [*state_shape], float32 (an empty [0] tensor for a mixer without a state)."""
        shape = self.state_shape if self.transition_kind is not None else (0,)
        return torch.zeros(shape, dtype=torch.float32, device=device)

    def identity_segment(self, runs: int, device: torch.device) -> SegmentState:
        """The empty span's map for `runs` runs: transition [runs, ...], state [runs, *state_shape]."""
        return SegmentState.identity(
            torch.zeros(runs, *self.state_shape, device=device),
            self.transition_kind or "matrix",
            None if self.vector_shape is None else (runs, *self.vector_shape),
        )

    @abstractmethod
    def project(self, x: torch.Tensor) -> Projections:
        """Token-wise projections of x [..., T, hidden] (input-normalised): no context needed."""

    @abstractmethod
    def convolve(self, preconv: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The short causal conv (and its activation) of n runs: preconv [n, T, C], each run with its own left
        context [n, C, kernel-1]. Returns [n, T, C] (preconv itself when the mixer has no conv)."""

    @abstractmethod
    def recurrence_inputs(
        self, convolved: torch.Tensor, projections: Projections, lengths: list[int] | None = None
    ) -> RecurrenceInputs:
        """The recurrence's inputs of n runs from convolved [n, T, C] and their projections ([n, T, ...]). Steps
        at or past a run's length (when `lengths` is given) must be identity steps."""

    @abstractmethod
    def run(self, inputs: RecurrenceInputs, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence of n runs from `start` [n, *state_shape] (None: zeros): outputs [n, T, *output_shape]
        and end states [n, *state_shape] (float32)."""

    @abstractmethod
    def run_with_transition(self, inputs: RecurrenceInputs) -> TransitionRun:
        """The recurrence of n runs from the identity start: outputs from a zero start, what the start state
        adds to them, and each run's affine map `SegmentState` (kind `transition_kind`)."""

    scans_runs: bool = False
    """True when `run_packed` is faster than running the runs from the identity start in one batch and composing
    (the stack then prefers it): a single scan over all runs' chunks, no widened state."""

    def run_packed(
        self, inputs: RecurrenceInputs, lengths: list[int], start: torch.Tensor,
        before_run: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs of ONE sequence packed end to end in one row of `inputs` ([1, sum(lengths)] steps, run r at steps
        sum(lengths[:r]) ..), in order: run r starts from `before_run(r, state)` (the state [*state_shape] where run
        r - 1 ended, `start` for r = 0; None: nothing between runs). Returns outputs [1, sum(lengths),
        *output_shape] and the end state [*state_shape].

        This default runs them one after the other through `run` (the reference for faster overrides)."""
        state = start.float()
        pieces: list[torch.Tensor] = []
        first = 0
        for run, count in enumerate(lengths):
            if before_run is not None:
                state = before_run(run, state)
            run_outputs, final = self.run(inputs.select(slice(0, 1), first, first + count), state[None])
            pieces.append(run_outputs)
            state = final[0]
            first += count
        if not pieces:
            raise ValueError("run_packed needs at least one run")
        return torch.cat(pieces, dim=1), state

    def step(
        self, projections: Projections, tails: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of n sequences, one token each: projections of the n tokens ([n, ...]: preconv [n, C]),
        their conv tails [n, C, W] and states [n, *state_shape] (float32; read, never written). Returns the
        recurrence outputs [n, *output_shape], the new conv tails [n, C, W] and end states [n, *state_shape].

        This default is the prefill's path over runs of one step (`convolve`, `recurrence_inputs`, `run`): the
        reference for faster overrides."""
        gathered = projections.map(lambda tensor: tensor[:, None])  # [n, 1, ...]
        convolved = self.convolve(gathered.preconv, tails)
        outputs, finals = self.run(self.recurrence_inputs(convolved, gathered), starts)
        preconv = projections.preconv
        new_tails = torch.cat([tails, preconv[:, :, None].float()], dim=2)[:, :, 1:] if tails.shape[-1] else tails
        return outputs[:, 0], new_tails, finals

    @abstractmethod
    def outputs_from_start(
        self, zero_outputs: torch.Tensor, transition_outputs: torch.Tensor | tuple[torch.Tensor, ...],
        start: torch.Tensor,
    ) -> torch.Tensor:
        """Outputs [n, T, *output_shape] of runs of a `TransitionRun` had they started from start
        [n, *state_shape] (exact: outputs are affine in the start state)."""

    @abstractmethod
    def output(self, core: torch.Tensor, projections: Projections, dtype: torch.dtype) -> torch.Tensor:
        """Token-wise output path: core [..., T, *output_shape] (recurrence outputs) with the tokens'
        projections [..., T, ...] -> [..., T, hidden] in `dtype`."""



class ModuleConv:
    """`conv_channels` and `conv_width` of a mixer whose wrapped `module` names its short conv's channels `conv_dim`
    and its kernel `conv_kernel_size` (Gated DeltaNet, KDA, Mamba2); listed before the mixer's base class."""

    module: torch.nn.Module

    @property
    def conv_channels(self) -> int:
        return int(self.module.conv_dim)

    @property
    def conv_width(self) -> int:
        return int(self.module.conv_kernel_size) - 1

class HeadMajorMixer(RecurrentMixer):
    """A recurrent mixer over head-major inputs whose start state S_0 [n, H, K, V] adds (w_t @ S_0) to output t,
    w_t [n, H, T, K] being its `TransitionRun.transition_outputs` (P_t^T q_t for the delta rules, exp(gamma_t) q_t
    for lightning, exp(cumulative dt a) c_t for SSD)."""

    def outputs_from_start(
        self, zero_outputs: torch.Tensor, transition_outputs: torch.Tensor, start: torch.Tensor
    ) -> torch.Tensor:
        """zero_outputs [n, T, H, V], transition_outputs [n, H, T, K], start [n, H, K, V] -> [n, T, H, V]."""
        return zero_outputs + (transition_outputs @ start).transpose(1, 2)


class DeltaRuleMixer(HeadMajorMixer):
    """Gated DeltaNet and KDA: `HeadMajorInputs` (query, key, value, log_decay, beta) through the op `recurrence`
    and its identity-start form `with_transition` (set by the subclass); outputs [n, T, H, V]."""

    recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    with_transition: Callable[..., tuple[torch.Tensor, torch.Tensor, SegmentState]]

    def run(self, inputs: RecurrenceInputs, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        output, final = type(self).recurrence(*inputs.as_tuple(), start)
        return output.transpose(1, 2), final

    def run_with_transition(self, inputs: RecurrenceInputs) -> TransitionRun:
        zero_outputs, transition_outputs, segment = type(self).with_transition(*inputs.as_tuple())
        return TransitionRun(zero_outputs.transpose(1, 2), transition_outputs, segment)

# ------------------------------------------------------------------------------------------------- attention


class Positioner(ABC):
    """How an attention mixer's queries and keys carry positions, and so how cached keys are re-positioned.

    `tables(positions)` precomputes what `apply` needs for integer positions [P]; `apply` positions x
    [..., H, T, D] at `index` (rows of the tables, a LongTensor [T] or a slice); `place` writes cached keys
    [H, L, D] positioned at `position .. position + L - 1` into buffer[:, at : at + L]. A positioner that
    `moves_keys` is False (NoPE) leaves keys as they are, so re-positioning is a no-op.
    """

    moves_keys: bool = True

    @abstractmethod
    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> Any:
        """Tables for positions [P] (on like's device, in like's dtype where it matters)."""

    @abstractmethod
    def apply(self, x: torch.Tensor, tables: Any, index: torch.Tensor | slice) -> torch.Tensor:
        """x [..., H, T, D] positioned at the table rows `index` [T]."""

    @abstractmethod
    def place(self, buffer: torch.Tensor, at: int, keys: torch.Tensor, tables: Any, position: int) -> None:
        """buffer[:, at : at + L] = keys [H, L, D] positioned at position .. position + L - 1."""


class NoPositions(Positioner):
    """NoPE (and MLA without RoPE): queries and keys carry no position; `place` copies."""

    moves_keys = False

    def tables(self, positions: torch.Tensor, like: torch.Tensor) -> None:
        return None

    def apply(self, x: torch.Tensor, tables: Any, index: torch.Tensor | slice) -> torch.Tensor:
        return x

    def place(self, buffer: torch.Tensor, at: int, keys: torch.Tensor, tables: Any, position: int) -> None:
        buffer[:, at : at + keys.shape[1]] = keys.to(device=buffer.device, dtype=buffer.dtype)


@dataclass(slots=True)
class AttentionProjections:
    """query [..., Hq, T, D] and key [..., Hkv, T, D] (normed, before any position), value [..., Hkv, T, Dv],
    and any token-wise tensors the output path needs (e.g. an output gate [..., T, Hq*Dv])."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    extras: tuple[torch.Tensor, ...] = ()


class AttentionMixer(ABC):
    """A full-attention mixer: `positions` (a `Positioner`), `scaling` (softmax scale), projections and the
    output path; the causal core by sequence index is the runtime's (`layers.attention_core`)."""

    positions: Positioner
    scaling: float

    @abstractmethod
    def project(self, x: torch.Tensor) -> AttentionProjections:
        """Token-wise q/k/v of x [..., T, hidden] (input-normalised), keys before any position."""

    @abstractmethod
    def output(self, core: torch.Tensor, projections: AttentionProjections) -> torch.Tensor:
        """core [..., T, Hq*Dv] (attention outputs) -> [..., T, hidden]."""


Mixer = RecurrentMixer | AttentionMixer
