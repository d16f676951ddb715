"""The one place that picks how conv tails are carried across spans (`backends.py` says which kernels may run).

- `advance_tail_cached`: one span's step in torch (what the single-request stack does per cached remainder);
- `stitch_conv_tails`: N requests over their own runs of spans, with the tail after every span on request:
  one launch of `hypic_rag.kernels.conv_tail` ("triton"), or the torch step per span ("torch").
`naive.py` is the reference both are tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hypic_rag.runtime.ops import backends


def advance_tail_cached(tail: torch.Tensor, cached_tail: torch.Tensor, suffix_length: int) -> torch.Tensor:
    """Conv tail [C, W] after a span of `suffix_length` tokens whose own last inputs are `cached_tail` [C, W]
    (right-aligned), from `tail` [C, W]. Float32."""
    width = tail.shape[-1]
    if width == 0 or suffix_length == 0:
        return tail
    if suffix_length >= width:
        return cached_tail.float().clone()
    return torch.cat([tail, cached_tail.float()[:, -suffix_length:]], dim=1)[:, -width:].contiguous()


def stitch_conv_tails(
    start: torch.Tensor | None,
    tails: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    counts: Sequence[int],
    *,
    store_steps: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Contract of `naive_stitch_conv_tails`: start [N, C, W] or None, tails [M, C, W], lengths [M], counts [N];
    returns end tails [N, C, W] (and the tail after every span [M, C, W]), float32."""
    if backends.resolve(backend, tails) == "triton":
        from hypic_rag.kernels.conv_tail import stitch_conv_tails as kernel

        return kernel(start, tails, lengths, counts, store_steps=store_steps)
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
