"""`LinearGroup` (`runtime/fast_linear.py`): layers that read the same input multiplied as one for one row. Its
fused product agrees with each layer's own (the reference, `ONE_ROW_FUSED` off) to float32 round-off, the layers'
parameters become views of the fused weight without changing a value, it falls back when a weight was replaced,
and a decode through the groups (GDN input projections, attention q/k/v, gated MLP gate/up) and the GDN layers'
short decode step (`FUSED_STEP`) gives transformers' greedy tokens over 32 steps and the reference's logits within
1e-5."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hypic_rag.runtime import fast_linear
from hypic_rag.runtime.fast_linear import LinearGroup, fast_view
from hypic_rag.runtime.mixers import gated_deltanet

needs_onednn = pytest.mark.skipif(not fast_linear.ONEDNN, reason="this torch has no oneDNN linear")


def _layers(bias: bool, widths: tuple[int, ...] = (70, 33, 5, 1)) -> nn.ModuleList:
    torch.manual_seed(len(widths) + bias)
    return fast_view(nn.ModuleList([nn.Linear(48, width, bias=bias) for width in widths]))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_through_the_group_matches_each_layer(bias: bool, monkeypatch) -> None:
    layers = _layers(bias)
    before = {name: tensor.clone() for name, tensor in layers.state_dict().items()}
    group = LinearGroup(list(layers))
    assert group.fused and group.weight is not None and group.weight.shape == (109, 48)
    for name, tensor in layers.state_dict().items():  # same values, now rows of the fused weight
        assert torch.equal(tensor, before[name])
    for layer, start in zip(layers, (0, 70, 103, 108)):
        assert layer.weight.data_ptr() == group.weight[start].data_ptr()
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, 48, generator=generator), torch.randn(1, 1, 48, generator=generator),
              torch.randn(48, 2, generator=generator)[:, 0][None], torch.randn(5, 48, generator=generator)]
    with torch.no_grad():
        fused = [group(x) for x in inputs]
        monkeypatch.setattr(fast_linear, "ONE_ROW_FUSED", False)
        reference = [group(x) for x in inputs]
        plain = [[torch.nn.functional.linear(x, layer.weight, layer.bias) for layer in layers] for x in inputs]
    for x, got, want, direct in zip(inputs, fused, reference, plain):
        assert [tuple(t.shape) for t in got] == [(*x.shape[:-1], width) for width in (70, 33, 5, 1)]
        for a, b, c in zip(got, want, direct):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


@needs_onednn
def test_the_group_follows_in_place_updates_and_falls_back_when_a_weight_is_replaced() -> None:
    layers = _layers(False, (20, 12))
    group = LinearGroup(list(layers))
    x = torch.randn(1, 48)
    with torch.no_grad():
        layers[0].weight.mul_(3.0)  # in place: the fused weight is the same memory
        assert group.fused
        torch.testing.assert_close(group(x)[0], layers[0](x), atol=1e-5, rtol=1e-5)
        layers[1].weight = nn.Parameter(torch.randn(12, 48))  # replaced: the group multiplies layer by layer
        assert not group.fused
        torch.testing.assert_close(group(x)[1], torch.nn.functional.linear(x, layers[1].weight), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_a_second_group_over_fused_layers_copies_nothing_and_unfusable_layers_are_left_alone() -> None:
    layers = _layers(True, (16, 8))
    first = LinearGroup(list(layers))
    second = LinearGroup(list(layers))  # e.g. the same model wrapped twice
    assert first.weight is not None and second.weight is not None
    assert second.weight.data_ptr() == first.weight.data_ptr() and second.fused and first.fused
    plain = nn.ModuleList([nn.Linear(48, 4), nn.Linear(48, 4, bias=False)])  # not FastLinear; biases mixed
    pointers = [layer.weight.data_ptr() for layer in plain]
    for group in (LinearGroup(list(plain)), LinearGroup(list(fast_view(plain)))):
        assert group.weight is None and not group.fused
    assert [layer.weight.data_ptr() for layer in plain] == pointers


@needs_onednn
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid", "jamba", "lfm2"])
def test_decode_through_the_groups_gives_transformers_greedy_tokens(model_type: str, monkeypatch) -> None:
    """32 greedy decode steps after a `full` prefill: transformers' own greedy `generate` tokens, and the next-token
    logits of the reference (every layer on its own, the generic GDN decode step) within 1e-5."""
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model
    from kits.corpora import random_request

    hf_model = build_tiny_model(model_type, seed=4)
    engine = Engine(wrap_model(hf_model), seam_tokens=4)
    groups = [group for block in engine.model.blocks for mixer in block.mixers
              for group in (getattr(mixer, "input_projections", None), getattr(mixer, "qkv", None)) if group is not None]
    assert groups and all(group.fused for group in groups)
    request = random_request(torch.Generator().manual_seed(2), [19, 26])
    ids = torch.tensor([request.all_ids()])
    steps = 32
    with torch.no_grad():
        expected = hf_model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)[0, ids.shape[1]:]

    def decode() -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            prefilled = engine.prefill(request, "full")
            state, token, tokens, logits = prefilled.state, int(prefilled.logits.argmax()), [], []
            for _ in range(steps - 1):
                tokens.append(token)
                step_logits, state = engine.decode_step(state, token)
                logits.append(step_logits)
                token = int(step_logits.argmax())
            tokens.append(token)
        return tokens, torch.stack(logits)

    fused_tokens, fused_logits = decode()
    monkeypatch.setattr(fast_linear, "ONE_ROW_FUSED", False)
    monkeypatch.setattr(gated_deltanet, "FUSED_STEP", False)  # and the generic decode step of the GDN layers
    reference_tokens, reference_logits = decode()
    assert fused_tokens == expected.tolist() == reference_tokens
    torch.testing.assert_close(fused_logits, reference_logits, atol=1e-5, rtol=1e-5)
