"""Float32 reference of the conv-tail stitch: the tail after a run of spans is the last W columns of everything the
conv has seen, [start tail | each span's last min(L, W) inputs], concatenated and cut (not stepped span by span, so
it checks the step-by-step paths independently)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def naive_stitch_conv_tails(
    start: torch.Tensor | None, tails: torch.Tensor, lengths: Sequence[int] | torch.Tensor, counts: Sequence[int], *,
    store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """start [N, C, W] (None: zeros); tails [M, C, W] (each span's own last W inputs, right-aligned); lengths [M]
    tokens per span; counts: spans per request (summing to M). Returns end tails [N, C, W] and with `store_steps`
    the tail after every span [M, C, W]; float32."""
    lengths = [int(length) for length in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    spans, channels, width = tails.shape
    if start is None:
        start = tails.new_zeros(len(counts), channels, width, dtype=torch.float32)
    ends, steps, first = [], [], 0
    for request, count in enumerate(counts):
        seen = start[request].float()
        for index in range(first, first + int(count)):
            taken = min(lengths[index], width)
            seen = torch.cat([seen, tails[index].float()[:, width - taken :]], dim=1)
            steps.append(seen[:, seen.shape[1] - width :])
        ends.append(seen[:, seen.shape[1] - width :])
        first += int(count)
    end = torch.stack(ends) if ends else tails.new_zeros(0, channels, width, dtype=torch.float32)
    if not store_steps:
        return end
    return end, (torch.stack(steps) if steps else tails.new_zeros(tails.shape, dtype=torch.float32))
