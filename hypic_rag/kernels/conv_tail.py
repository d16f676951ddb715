"""The conv-tail stitch in one Triton launch: each request's conv tail carried across its spans, batched.

A short causal conv of kernel W + 1 needs the W pre-conv inputs before a span's first token: the conv tail
[C, W] (docs/design.md, section 2). Walking a request's spans, the tail after a span of L tokens whose own last
inputs are `tails[i]` [C, W] (a cached chunk's stored tail, or a recomputed run's last W inputs, right-aligned) is
the last W columns of [tail | the span's last min(L, W) inputs]:

    new[:, j] = tail[:, j + l]  for j < W - l,   tails[i][:, j]  otherwise   (l = min(L, W))

`stitch_conv_tails` runs that for N requests, each over its own run of spans (per-request counts), one program
per (request, block of channels) holding the tail in registers in float32 (the column shift is a select over the
W columns: W is kernel - 1, 1 to 3 in every family), optionally storing the tail after every span (the contexts
the recomputed runs start from). The float32 reference is `hypic_rag.runtime.ops.conv_tail.naive_stitch_conv_tails`;
the runtime reaches this module only through `hypic_rag.runtime.ops.conv_tail`. Runs under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hypic_rag.kernels.runs import request_runs, strides

BLOCK_C = 128
"""Channels per program."""


@triton.jit
def _stitch_kernel(
    start_ptr, tails_ptr, lengths_ptr, out_ptr, steps_ptr, first_ptr, count_ptr, CHANNELS, WIDTH, stride_start_n,
    stride_start_c, stride_start_w, stride_tails_m, stride_tails_c, stride_tails_w, stride_out_n, stride_out_c,
    stride_out_w, stride_steps_m, stride_steps_c, stride_steps_w, MAX_COUNT: tl.constexpr, BLOCK_CHANNELS: tl.constexpr,
    BLOCK_W: tl.constexpr, HAS_START: tl.constexpr, STORE_STEPS: tl.constexpr,
):
    request = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    columns = tl.arange(0, BLOCK_W)
    ok = (channels < CHANNELS)[:, None] & (columns < WIDTH)[None, :]
    first = tl.load(first_ptr + request)
    count = tl.load(count_ptr + request)
    if HAS_START:
        start = start_ptr + request * stride_start_n
        tail = tl.load(
            start + channels[:, None] * stride_start_c + columns[None, :] * stride_start_w, mask=ok, other=0.0
        ).to(tl.float32)
    else:
        tail = tl.zeros([BLOCK_CHANNELS, BLOCK_W], dtype=tl.float32)

    for step in range(MAX_COUNT):
        if step < count:
            index = first + step
            length = tl.minimum(tl.load(lengths_ptr + index), WIDTH)
            piece = tl.load(
                tails_ptr + index * stride_tails_m + channels[:, None] * stride_tails_c
                + columns[None, :] * stride_tails_w,
                mask=ok,
                other=0.0,
            ).to(tl.float32)
            # shifted[:, j] = tail[:, j + length]: pick column j + length of the tail (exact: one term, zeros else)
            source = columns + length
            picked = tl.where(columns[None, None, :] == source[None, :, None], tail[:, None, :], 0.0)
            shifted = tl.sum(picked, axis=2)
            tail = tl.where((columns < WIDTH - length)[None, :], shifted, piece)
            if STORE_STEPS:
                tl.store(
                    steps_ptr + index * stride_steps_m + channels[:, None] * stride_steps_c
                    + columns[None, :] * stride_steps_w,
                    tail,
                    mask=ok,
                )

    out = out_ptr + request * stride_out_n
    tl.store(out + channels[:, None] * stride_out_c + columns[None, :] * stride_out_w, tail, mask=ok)


def stitch_conv_tails(
    start: torch.Tensor | None, tails: torch.Tensor, lengths: torch.Tensor | Sequence[int], counts: Sequence[int], *,
    store_steps: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Carry N requests' conv tails across their own runs of spans, in one launch.

    start: [N, C, W] (any float dtype and strides; None: zeros); tails: [M, C, W] the spans' own last W inputs
    (right-aligned: a span of L < W tokens holds its inputs in the last L columns); lengths: [M] tokens per span
    (>= 0; 0 leaves the tail alone); request n's spans are rows sum(counts[:n]) .. sum(counts[:n+1]) - 1.
    Returns the end tails [N, C, W] float32, and with `store_steps` the tail after every span [M, C, W] float32.
    """
    spans, channels, width = tails.shape
    runs = request_runs(counts, spans, tails.device)
    requests = len(runs.counts)
    if start is not None and tuple(start.shape) != (requests, channels, width):
        raise ValueError(f"start {tuple(start.shape)} does not match {requests} requests of tails [{channels}, {width}]")
    lengths = torch.as_tensor(lengths, dtype=torch.int64).to(tails.device)
    if tuple(lengths.shape) != (spans,):
        raise ValueError(f"lengths {tuple(lengths.shape)} must give one length per span ({spans})")
    out = torch.empty(requests, channels, width, dtype=torch.float32, device=tails.device)
    steps = torch.empty(spans, channels, width, dtype=torch.float32, device=tails.device) if store_steps else None
    if requests == 0 or channels == 0 or width == 0:
        if start is not None:
            out.copy_(start)
        if steps is not None:
            steps.zero_()
        return (out, steps) if store_steps else out
    block_w = max(2, triton.next_power_of_2(width))
    block_channels = min(BLOCK_C, max(16, triton.next_power_of_2(channels)))
    _stitch_kernel[(requests, triton.cdiv(channels, block_channels))](
        start if start is not None else out,
        tails,
        lengths,
        out,
        steps if steps is not None else out,
        runs.first,
        runs.count,
        channels,
        width,
        *strides(start, 3),
        *tails.stride(),
        *out.stride(),
        *strides(steps, 3),
        MAX_COUNT=runs.max_count,
        BLOCK_CHANNELS=block_channels,
        BLOCK_W=block_w,
        HAS_START=start is not None,
        STORE_STEPS=store_steps,
        num_warps=4,
    )
    return (out, steps) if store_steps else out
