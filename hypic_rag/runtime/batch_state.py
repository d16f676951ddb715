"""The decode state of one running sequence in a stack pass: `SequenceState`, with room for the tokens it will decode.

`DecodeState` (state.py) holds each attention layer's keys and values at exactly the consumed length, so a pass that
starts from one copies them into a new buffer (with room for its new tokens). A running sequence of the pass
(`stack.run_batch`, driven by the engine's step function) keeps them in buffers with spare capacity instead, and a
decode step writes its one new key and value in place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hypic_rag.runtime.state import AttentionLayerState, DecodeState, LinearLayerState


@dataclass(slots=True)
class SequenceState:
    """length: tokens consumed. linear: per linear layer the recurrent state [H, K, V] (float32) and conv tail
    [C, kernel-1]. keys / values: per attention layer buffers [H_kv, capacity, D]; positions 0..length-1 hold the
    sequence's keys (rotated at their positions) and values, the rest is room for later tokens."""

    length: int
    linear: dict[int, LinearLayerState] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        """Positions the attention buffers hold (the length when there is no attention layer)."""
        return min((buffer.shape[1] for buffer in self.keys.values()), default=self.length)

    def ensure_capacity(self, positions: int) -> None:
        """Grow the attention buffers (to at least twice their size) when they hold fewer than `positions`."""
        if positions <= self.capacity or not self.keys:
            return
        size = max(positions, 2 * self.capacity)
        for table in (self.keys, self.values):
            for layer_index, buffer in table.items():
                grown = buffer.new_empty(buffer.shape[0], size, buffer.shape[2])
                grown[:, : self.length] = buffer[:, : self.length]
                table[layer_index] = grown

    @classmethod
    def from_decode_state(cls, state: DecodeState, reserve: int = 0) -> SequenceState:
        """A copy of `state` with room for `reserve` more tokens (the linear states are shared, never written)."""
        copy = cls(length=state.length, linear=dict(state.linear))
        for layer_index, item in state.attention.items():
            for table, tensor in ((copy.keys, item.keys), (copy.values, item.values)):
                buffer = tensor.new_empty(tensor.shape[0], state.length + reserve, tensor.shape[2])
                buffer[:, : state.length] = tensor
                table[layer_index] = buffer
        return copy

    def to_decode_state(self) -> DecodeState:
        """The same state as a `DecodeState` (keys and values are views of the buffers up to `length`)."""
        attention = {
            layer_index: AttentionLayerState(keys[:, : self.length], self.values[layer_index][:, : self.length])
            for layer_index, keys in self.keys.items()
        }
        return DecodeState(length=self.length, linear=dict(self.linear), attention=attention)

