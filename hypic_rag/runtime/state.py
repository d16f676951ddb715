"""Decode state after a prefill: one recurrent state and conv tail per linear layer, rotated K/V per attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LinearLayerState:
    """A recurrent mixer's decode state: recurrent [*state_shape] float32 (Gated DeltaNet [H, K, V]; empty for a
    mixer without a recurrent state); conv_tail [C, kernel-1] (the last conv inputs)."""

    recurrent: torch.Tensor
    conv_tail: torch.Tensor


@dataclass(slots=True)
class AttentionLayerState:
    """keys: [H_kv, N, D] already rotated at their positions; values: [H_kv, N, D]."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass(slots=True)
class DecodeState:
    """Everything the next token needs: `length` tokens have been consumed."""

    length: int
    linear: dict[int, LinearLayerState] = field(default_factory=dict)
    attention: dict[int, AttentionLayerState] = field(default_factory=dict)

    def nbytes(self) -> int:
        total = 0
        for item in self.linear.values():
            total += item.recurrent.numel() * item.recurrent.element_size()
            total += item.conv_tail.numel() * item.conv_tail.element_size()
        for item in self.attention.values():
            total += item.keys.numel() * item.keys.element_size() + item.values.numel() * item.values.element_size()
        return total
