"""MiniMax's per-head decay rates (ALiBi-style geometric slopes, scaled down with depth)."""

from __future__ import annotations

import torch


def minimax_log_decay(num_heads: int, layer_index: int, num_layers: int) -> torch.Tensor:
    """log_decay [H, 1] = -slope_h for lightning layer `layer_index` of a `num_layers`-layer MiniMax model.

    slope_h = (2^(-8/H))^(h+1) * (1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5), h = 0 .. H-1 (float32), the
    per-token decay is exp(-slope_h). Deeper layers decay more slowly; the last layer barely decays at all.
    """
    if num_heads < 1 or num_layers < 1 or not 0 <= layer_index < num_layers:
        raise ValueError(
            f"need num_heads >= 1 and 0 <= layer_index < num_layers, got {num_heads}, {layer_index}, {num_layers}"
        )
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    factor = 1 - layer_index / (num_layers - 1 + 1e-5) + 1e-5
    return -(rate * factor)[:, None]
