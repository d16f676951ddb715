"""The torch step of the conv tail carried across spans, and the torch backend of stitching many requests' tails
(`ops/registry.py` picks it, or the batched Triton kernel `hypic_rag.kernels.conv_tail`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def advance_tail_cached(tail: torch.Tensor, cached_tail: torch.Tensor, suffix_length: int) -> torch.Tensor:
    """Conv tail [C, W] after a span of `suffix_length` tokens whose own last inputs are `cached_tail` [C, W]
    (right-aligned), from `tail` [C, W]. Float32."""
    width = tail.shape[-1]
    if width == 0 or suffix_length == 0:
        return tail
    if suffix_length >= width:
        return cached_tail.float().clone()
    return torch.cat([tail, cached_tail.float()[:, -suffix_length:]], dim=1)[:, -width:].contiguous()


def stitch_conv_tails_torch(
    start: torch.Tensor | None, tails: torch.Tensor, lengths: Sequence[int] | torch.Tensor, counts: Sequence[int],
    store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_stitch_conv_tails`, one `advance_tail_cached` step per span."""
    lengths = [int(length) for length in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    spans, channels, width = tails.shape
    ends, steps, first = [], [], 0
    for request, count in enumerate(counts):
        tail = tails.new_zeros(channels, width, dtype=torch.float32) if start is None else start[request].float()
        for index in range(first, first + int(count)):
            tail = advance_tail_cached(tail, tails[index], lengths[index])
            steps.append(tail)
        ends.append(tail)
        first += int(count)
    end = torch.stack(ends) if ends else tails.new_zeros(0, channels, width, dtype=torch.float32)
    if not store_steps:
        return end
    return end, (torch.stack(steps) if steps else tails.new_zeros(tails.shape, dtype=torch.float32))
