"""Runs of maps per request, as the batched kernels take them: request n owns rows sum(counts[:n]) ..
sum(counts[:n+1]) - 1 of the stacked maps (`compose.py`, `compose_elementwise.py`, `conv_tail.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton


@dataclass(slots=True)
class Runs:
    """counts: maps per request; first / count [N] int64 on the kernel's device (offsets never overflow);
    max_count: the loop bound the kernels compile in (the longest run rounded up to a power of two: the
    interpreter cannot take a loop bound from a runtime value, and a handful of compiled variants on a GPU)."""

    counts: list[int]
    first: torch.Tensor
    count: torch.Tensor
    max_count: int


def request_runs(counts: Sequence[int], maps: int, device: torch.device) -> Runs:
    """Check `counts` (non-negative, summing to `maps`) and lay them out for a kernel on `device`."""
    counts = [int(count) for count in counts]
    if any(count < 0 for count in counts) or sum(counts) != maps:
        raise ValueError(f"counts {counts} must be non-negative and sum to the {maps} maps")
    firsts = [sum(counts[:n]) for n in range(len(counts))]
    return Runs(
        counts,
        torch.tensor(firsts, dtype=torch.int64, device=device),
        torch.tensor(counts, dtype=torch.int64, device=device),
        triton.next_power_of_2(max(max(counts, default=0), 1)),
    )


def strides(tensor: torch.Tensor | None, rank: int) -> tuple[int, ...]:
    """The tensor's strides, or zeros for an absent operand (the kernel never reads it)."""
    return tuple(tensor.stride()) if tensor is not None else (0,) * rank
