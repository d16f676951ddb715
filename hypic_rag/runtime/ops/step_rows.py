"""What the head-major step recurrences (gated delta rule, KDA, lightning) share: their tensors as rows of heads
(batch and heads merged: [B*H, T, D]), the start state as one fresh [B*H, K, V] float32 tensor updated in place, and
the per-step outputs joined back into [B, H, T, V]."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def start_rows(key: torch.Tensor, value: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """The start state [B*H, K, V] float32 for key [B, H, T, K], value [B, H, T, V]: a copy of initial_state
    [B, H, K, V] (never the caller's tensor), or zeros without one."""
    batch, heads, _, key_dim = key.shape
    value_dim = value.shape[-1]
    if initial_state is None:
        return torch.zeros(batch * heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    return initial_state.float().reshape(batch * heads, key_dim, value_dim).clone()


def head_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[B, H, T, D] tensors as float32 rows [B*H, T, D]."""
    return [x.float().reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[-1]) for x in tensors]


def joined_outputs(
    outputs: Sequence[torch.Tensor], state: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-step outputs [B*H, 1, V] joined into [B, H, T, V] (T = 0: empty) and the state [B*H, K, V] as
    [B, H, K, V], for key [B, H, T, K] and value [B, H, T, V]."""
    batch, heads, length, key_dim = key.shape
    value_dim = value.shape[-1]
    output = torch.cat(list(outputs), dim=1) if outputs else state.new_zeros(batch * heads, 0, value_dim)
    return output.reshape(batch, heads, length, value_dim), state.reshape(batch, heads, key_dim, value_dim)
