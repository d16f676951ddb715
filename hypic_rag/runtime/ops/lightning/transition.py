"""The affine map of a scalar-decay span: S_end = p S_0 + Z with p = exp(sum_t g_t) one scalar per (batch, head).

For MiniMax's constant decay p = exp(-slope_h * T). The outputs split the same way: o_t = Z_t^T q_t + exp(gamma_t)
S_0^T q_t (gamma_t = g_1 + ... + g_t), so the outputs for any later start S_0 are
`output_zero_start + output_start_weight[..., None] * (query @ S_0)` without running the span again.
The cached operator is B*H floats per span and layer; composition is p_XY = p_Y p_X, Z_XY = p_Y Z_X + Z_Y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hypic_rag.runtime.ops.lightning.chunk import DEFAULT_CHUNK_SIZE
from hypic_rag.runtime.ops.registry import call


@dataclass(slots=True)
class ScalarDecaySpan:
    """Affine map of one span with a scalar transition: `apply(S_0) = decay * S_0 + state`;
    decay [...] (one per batch and head), state [..., K, V]; float32."""

    decay: torch.Tensor
    state: torch.Tensor

    def __post_init__(self) -> None:
        if tuple(self.decay.shape) != tuple(self.state.shape[:-2]):
            raise ValueError(
                f"decay must have shape {tuple(self.state.shape[:-2])} for a state of shape "
                f"{tuple(self.state.shape)}, got {tuple(self.decay.shape)}"
            )

    def apply(self, start: torch.Tensor) -> torch.Tensor:
        """End state [..., K, V] of the span started from `start` [..., K, V]."""
        return self.decay[..., None, None] * start.float() + self.state

    def then(self, later: ScalarDecaySpan) -> ScalarDecaySpan:
        """This span followed by `later`."""
        return ScalarDecaySpan(later.decay * self.decay, later.apply(self.state))


def lightning_with_transition(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_decay: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, ScalarDecaySpan]:
    """Run a span from S_0 = 0 and return its outputs and affine map.

    Args:
        query, key: [B, H, T, K]; value: [B, H, T, V]; log_decay: broadcastable to [B, H, T].
    Returns:
        output_zero_start [B, H, T, V]: outputs when the span starts from S_0 = 0;
        output_start_weight [B, H, T]: exp(gamma_t), so outputs for start S_0 add weight * (q_t^T S_0);
        ScalarDecaySpan with decay [B, H] (exp of the summed log decay) and state Z [B, H, K, V].
    """
    batch, heads, length = key.shape[:3]
    output, state = call("lightning", query=query, key=key, value=value, log_decay=log_decay, initial_state=None,
                         chunk_size=chunk_size)
    cumulative = log_decay.to(device=value.device, dtype=torch.float32).expand(batch, heads, length).cumsum(-1)
    total = cumulative[..., -1] if length else cumulative.new_zeros(batch, heads)
    return output, cumulative.exp(), ScalarDecaySpan(total.exp(), state)
