"""The Mamba time step: dt = softplus(raw + bias), clamped to a (low, high) limit.

Mamba1 (jamba) and Mamba2 / SSD (bamba, granitemoehybrid, nemotron_h, falcon_h1, zamba2) both discretise with
dt = softplus(raw + bias); the SSD mixers then clamp to their module's `time_step_limit` (zamba2, and nemotron_h
before transformers 5.25: (time_step_min, inf)) in their chunked prefill path. transformers' single-token decode
step does NOT clamp, so a runtime that must match transformers' `generate` token for token passes `limit=None` for
decode steps.
"""

from __future__ import annotations

import torch


def softplus_time_step(
    raw: torch.Tensor, bias: torch.Tensor | None = None, limit: tuple[float, float] | None = None
) -> torch.Tensor:
    """dt = clamp(softplus(raw + bias), *limit) in float32.

    Args:
        raw: the projected time step, any shape whose last dimension matches `bias` (or anything when bias is None).
        bias: per-head (SSD, [H]) or per-channel (Mamba1, [D]) bias broadcast over the last dimension, or None.
        limit: (low, high) clamp, or None for no clamp (softplus is already >= 0).
    Returns:
        dt, float32, same shape as `raw`.
    """
    time_step = raw.float()
    if bias is not None:
        time_step = time_step + bias.float()
    time_step = torch.nn.functional.softplus(time_step)
    if limit is not None:
        low, high = limit
        time_step = time_step.clamp(min=low, max=high)
    return time_step
