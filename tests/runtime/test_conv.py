"""`layers.causal_depthwise_conv` (shifted multiply-adds over rows) against `F.conv1d` on the transposed input, the
reference every mixer used before it: random shapes, kernels 1-5, with and without bias and left context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hypic_rag.runtime.layers import causal_depthwise_conv


def conv1d_reference(preconv: torch.Tensor, context: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    conv_input = torch.cat([context.to(weight.dtype), preconv.transpose(1, 2).to(weight.dtype)], dim=2)
    return F.conv1d(conv_input, weight, bias, groups=conv_input.shape[1]).transpose(1, 2)


@pytest.mark.parametrize("kernel", [1, 2, 4, 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("runs,length,channels", [(1, 1, 8), (3, 17, 24), (2, 130, 64)])
def test_matches_conv1d(kernel: int, with_bias: bool, runs: int, length: int, channels: int) -> None:
    generator = torch.Generator().manual_seed(kernel * 100 + length)
    preconv = torch.randn(runs, length, channels, generator=generator)
    context = torch.randn(runs, channels, kernel - 1, generator=generator)
    weight = torch.randn(channels, 1, kernel, generator=generator)
    bias = torch.randn(channels, generator=generator) if with_bias else None
    out = causal_depthwise_conv(preconv, context, weight, bias)
    assert out.shape == (runs, length, channels) and out.is_contiguous()
    torch.testing.assert_close(out, conv1d_reference(preconv, context, weight, bias), atol=1e-5, rtol=1e-5)


def test_a_strided_input_and_a_zero_context() -> None:
    """A non-contiguous preconv (a column slice of the projections) and an all-zero context (a run at position 0)."""
    generator = torch.Generator().manual_seed(7)
    projections = torch.randn(2, 40, 100, generator=generator)
    preconv = projections[..., 10:74]
    context = torch.zeros(2, 64, 3)
    weight = torch.randn(64, 1, 4, generator=generator)
    torch.testing.assert_close(
        causal_depthwise_conv(preconv, context, weight, None), conv1d_reference(preconv, context, weight, None),
        atol=1e-5, rtol=1e-5,
    )


def test_gradients_match_conv1d() -> None:
    """Training runs the mixers under autograd: the gradients agree with the conv1d reference's."""
    generator = torch.Generator().manual_seed(3)
    tensors = [torch.randn(2, 9, 6, generator=generator), torch.randn(2, 6, 3, generator=generator),
               torch.randn(6, 1, 4, generator=generator), torch.randn(6, generator=generator)]
    ours = [t.clone().requires_grad_() for t in tensors]
    reference = [t.clone().requires_grad_() for t in tensors]
    causal_depthwise_conv(*ours).square().sum().backward()
    conv1d_reference(*reference).square().sum().backward()
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
