"""The conv-tail stitch kernel (`hypic_rag.kernels.conv_tail`) and the torch step of `ops.conv_tail` against the
concatenate-and-cut reference, and against running a real causal conv over the joined spans."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.kernels.conv_tail import stitch_conv_tails as kernel
from hypic_rag.runtime import layers as L
from hypic_rag.runtime.ops.conv_tail import naive_stitch_conv_tails, stitch_conv_tails
from kernel_support import DEVICE, STORAGE_DTYPES


def random_spans(counts: list[int], channels: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    spans = sum(counts)
    tails = torch.randn(spans, channels, width, generator=generator)
    lengths = torch.randint(0, width + 3, (spans,), generator=generator)
    lengths[::3] = torch.arange(len(lengths[::3])) % (width + 1)  # every length 0 .. W shows up
    start = torch.randn(len(counts), channels, width, generator=generator)
    return start, tails, lengths


@pytest.mark.parametrize("width", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", STORAGE_DTYPES, ids=str)
def test_stitch_matches_reference(width: int, dtype: torch.dtype) -> None:
    counts = [4, 0, 7, 1, 2]
    start, tails, lengths = random_spans(counts, channels=150, width=width, seed=width)  # > one block of channels
    tails = tails.to(dtype)
    out, steps = kernel(start.to(DEVICE), tails.to(DEVICE), lengths, counts, store_steps=True)
    expected, expected_steps = naive_stitch_conv_tails(start, tails, lengths, counts, store_steps=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), expected, atol=0, rtol=0)  # a copy of values: exact
    torch.testing.assert_close(steps.cpu(), expected_steps, atol=0, rtol=0)
    torch.testing.assert_close(out[1].cpu(), start[1])  # no spans: the start tail itself
    for backend in ("torch", "triton"):  # the dispatch: both paths
        got = stitch_conv_tails(start.to(DEVICE), tails.to(DEVICE), lengths, counts, backend=backend)
        torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=0)


def test_stitch_zero_start_and_strided_inputs() -> None:
    counts = [3, 2]
    start, tails, lengths = random_spans(counts, channels=20, width=3, seed=9)
    wide = torch.randn(5, 20, 6)
    strided = wide[..., ::2]  # non-contiguous tails
    out = kernel(None, strided.to(DEVICE), lengths, counts)
    torch.testing.assert_close(out.cpu(), naive_stitch_conv_tails(None, strided, lengths, counts), atol=0, rtol=0)


def test_stitched_tail_is_what_a_conv_over_the_joined_spans_needs() -> None:
    """The tail after spans of 1, 5 and 2 tokens (each keeping its own last 3 inputs) equals the last 3 inputs of
    the joined token stream; conv-ing the next span with it equals conv-ing the whole stream."""
    generator = torch.Generator().manual_seed(10)
    channels, width = 6, 3
    pieces = [torch.randn(n, channels, generator=generator) for n in (1, 5, 2)]
    start = torch.randn(channels, width, generator=generator)
    own_tails = torch.stack([L.advance_conv_tail(torch.zeros(channels, width), piece) for piece in pieces])
    out = kernel(start[None].to(DEVICE), own_tails.to(DEVICE), [1, 5, 2], [3])[0].cpu()
    stream = torch.cat([start.T, *pieces])
    torch.testing.assert_close(out, stream[-width:].T, atol=0, rtol=0)
    weight, nxt = torch.randn(channels, 1, width + 1, generator=generator), torch.randn(4, channels, generator=generator)
    whole = L.causal_depthwise_conv(torch.cat([stream, nxt])[None], torch.zeros(1, channels, width), weight, None)
    torch.testing.assert_close(L.causal_depthwise_conv(nxt[None], out[None], weight, None), whole[:, -4:])


def test_stitch_rejects_mismatched_inputs() -> None:
    start, tails, lengths = random_spans([2, 1], channels=4, width=3, seed=11)
    with pytest.raises(ValueError, match="sum to the 3 maps"):
        kernel(None, tails.to(DEVICE), lengths, [2])
    with pytest.raises(ValueError, match="one length per span"):
        kernel(None, tails.to(DEVICE), lengths[:2], [2, 1])
    with pytest.raises(ValueError, match="does not match"):
        kernel(start[:1].to(DEVICE), tails.to(DEVICE), lengths, [2, 1])
