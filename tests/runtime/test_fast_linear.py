"""The oneDNN linear (`runtime/fast_linear.py`) agrees with `F.linear` to float32 round-off, its rows do not depend
on the rows beside them beyond round-off, it falls back where it must (gradients, other dtypes), and `fast_view` makes
plain `nn.Linear` modules `FastLinear` in a view that shares the parameters, leaving the module it was made from as it
was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hypic_rag.runtime import fast_linear
from hypic_rag.runtime.fast_linear import FastLinear, fast_view, onednn_eligible, onednn_linear

needs_onednn = pytest.mark.skipif(not fast_linear.ONEDNN, reason="this torch has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows: int, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator)
    offset = torch.randn(96, generator=generator) if bias else None
    x = torch.randn(rows, 40, generator=generator)
    assert onednn_eligible(x, weight, offset)
    torch.testing.assert_close(onednn_linear(x, weight, offset), F.linear(x, weight, offset), atol=1e-5, rtol=1e-5)
    batched = torch.randn(2, rows, 40, generator=generator)  # leading batch dims
    torch.testing.assert_close(onednn_linear(batched, weight, offset), F.linear(batched, weight, offset),
                               atol=1e-5, rtol=1e-5)
    strided = torch.randn(40, rows, generator=generator).t()  # a non-contiguous input
    torch.testing.assert_close(onednn_linear(strided, weight, offset), F.linear(strided, weight, offset),
                               atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_row_alone_and_among_others_agrees() -> None:
    """A row's result alone and among others agrees to float32 round-off (oneDNN may pick another kernel for one
    row than for eight, so not bit for bit)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 128, generator=generator)
    x = torch.randn(8, 128, generator=generator)
    together = onednn_linear(x, weight)
    for row in range(8):
        torch.testing.assert_close(onednn_linear(x[row : row + 1], weight)[0], together[row], atol=1e-5, rtol=1e-5)


def test_falls_back_where_it_must() -> None:
    weight = torch.randn(6, 4, requires_grad=True)
    x = torch.randn(3, 4)
    assert not onednn_eligible(x, weight)  # autograd wants the gradient of the weight
    out = onednn_linear(x, weight)
    out.sum().backward()
    assert weight.grad is not None
    with torch.no_grad():
        assert onednn_eligible(x, weight) == fast_linear.ONEDNN
    assert not onednn_eligible(x.double(), weight.detach().double())
    assert not onednn_eligible(torch.randn(0, 4), weight.detach())
    empty = onednn_linear(torch.randn(0, 4), weight.detach())
    assert empty.shape == (0, 6)


class _Scaled(nn.Linear):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return 2 * super().forward(input)


@needs_onednn
def test_fast_view_makes_plain_linears_fast_over_the_same_parameters_and_leaves_the_module_as_it_was() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), _Scaled(16, 16), shared, shared, nn.Linear(16, 4, bias=False))
    model.train()
    x = torch.randn(5, 8)
    with torch.no_grad():
        before = model(x)
    modules = list(model.modules())
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    view = fast_view(model).eval()
    assert [type(child) for child in view] == [FastLinear, nn.ReLU, _Scaled, FastLinear, FastLinear, FastLinear]
    assert view[3] is view[4] and view[3] is not shared  # one copy of a module reached twice
    assert all(view_param is param for view_param, param in zip(view.parameters(), model.parameters()))
    assert view.state_dict().keys() == state.keys()
    # the module it was made from: same objects, same classes, same training flag, same weights, same output
    assert list(model.modules()) == modules and all(type(child) is not FastLinear for child in model.modules())
    assert model.training and all(child.training for child in model.modules())
    assert not any(child.training for child in view.modules())
    with torch.no_grad():
        torch.testing.assert_close(view(x), before, atol=1e-5, rtol=1e-5)
        assert torch.equal(model(x), before)
        model[0].weight.mul_(2.0)  # shared tensors: an in-place update shows in the view
        torch.testing.assert_close(view(x), model(x), atol=1e-5, rtol=1e-5)
        model[0].weight.div_(2.0)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name])


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 8, 64, 128, 129])
def test_fast_linear_with_its_packed_weight_matches_and_follows_weight_changes(rows: int, monkeypatch) -> None:
    """2..PACKED_MAX_ROWS rows go through the packed copy of the weight; it is remade when the weight is written in
    place (load_state_dict) or replaced; HYPIC_RAG_PACKED_LINEARS=0 keeps to the dense weight."""
    torch.manual_seed(rows)
    layer = fast_view(nn.Linear(48, 80))
    x = torch.randn(rows, 48)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.load_state_dict({"weight": torch.randn(80, 48), "bias": torch.randn(80)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        layer.weight = nn.Parameter(torch.randn(80, 48))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("HYPIC_RAG_PACKED_LINEARS", "0")
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    packs = "_packed" in layer.__dict__
    assert packs == (2 <= rows <= fast_linear.PACKED_MAX_ROWS)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_through_blas_matches_the_onednn_reference(bias: bool, monkeypatch) -> None:
    """One row (a batch-1 decode step) goes through `F.linear` (ONE_ROW_BLAS); it agrees with the oneDNN product of
    the same row (ONE_ROW_BLAS off, the reference) to float32 round-off, with leading batch dims and strides too."""
    generator = torch.Generator().manual_seed(11)
    layer = fast_view(nn.Linear(200, 330, bias=bias))
    inputs = [torch.randn(1, 200, generator=generator), torch.randn(1, 1, 200, generator=generator),
              torch.randn(200, 3, generator=generator)[:, 1][None]]  # the last one a strided view
    with torch.no_grad():
        fast = [layer(x) for x in inputs]
        monkeypatch.setattr(fast_linear, "ONE_ROW_BLAS", False)
        reference = [layer(x) for x in inputs]
    for x, got, want in zip(inputs, fast, reference):
        assert got.shape == want.shape == (*x.shape[:-1], 330)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_decode_with_one_row_blas_matches_the_onednn_decode(monkeypatch) -> None:
    """A random qwen3_5 model's decode (32 greedy steps after a prefill): the same tokens and next-token logits
    within float32 round-off whether one-row products go through BLAS (the fast path) or oneDNN (the reference)."""
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model
    from kits.corpora import random_request

    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=4)
    request = random_request(torch.Generator().manual_seed(1), [19, 33])

    def decode(steps: int = 32) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            prefilled = engine.prefill(request, "full")
            state, token, tokens, logits = prefilled.state, int(prefilled.logits.argmax()), [], []
            for _ in range(steps):
                step_logits, state = engine.decode_step(state, token)
                token = int(step_logits.argmax())
                tokens.append(token)
                logits.append(step_logits)
        return tokens, torch.stack(logits)

    fast_tokens, fast_logits = decode()
    monkeypatch.setattr(fast_linear, "ONE_ROW_BLAS", False)
    reference_tokens, reference_logits = decode()
    assert fast_tokens == reference_tokens
    torch.testing.assert_close(fast_logits, reference_logits, atol=1e-5, rtol=1e-5)
