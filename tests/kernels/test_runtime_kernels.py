"""The runtime driven through the Triton kernels (HYPIC_RAG_KERNELS=triton; on CPU under the interpreter) equals its
torch code (the stack's kernel switch off) in every mode that composes cached entries."""

from __future__ import annotations

import pytest
import torch

import hypic_rag.kernels.compose as compose_module
import hypic_rag.kernels.rope as rope_module
from hypic_rag.runtime import recurrent_pass
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.runtime.request import Request
from kernel_support import DEVICE, RUNTIME_TOLERANCE

COMPOSED_MODES = ("addition", "transition", "transition_rope", "hypic")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def engine(request) -> Engine:
    model = wrap_model(build_tiny_model(request.param, seed=4, num_hidden_layers=4).to(DEVICE))
    return Engine(model, seam_tokens=3)


def random_request(seed: int) -> Request:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    return Request(ids(4), [ids(n) for n in (11, 7, 16, 9)], ids(5))


@pytest.mark.parametrize("mode", COMPOSED_MODES)
def test_kernel_path_equals_torch_path(engine: Engine, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    request = random_request(0)
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "triton")  # on CPU through the interpreter; fla (GPU) in both runs
    with monkeypatch.context() as torch_path:  # the stack's own kernels off (composition's switch): its torch code
        torch_path.setattr(recurrent_pass, "triton_enabled", lambda tensor: False)
        expected = engine.prefill(request, mode)

    launches: dict[str, list[int]] = {"compose": [], "rope": []}
    real_compose, real_rope = compose_module.compose_affine, rope_module.rope_into

    def counting_compose(start, transitions, states, **options):
        launches["compose"].append(states.shape[0])
        return real_compose(start, transitions, states, **options)

    def counting_rope(out, out_start, keys, cos, sin, position_start):
        launches["rope"].append(keys.shape[1])
        return real_rope(out, out_start, keys, cos, sin, position_start)

    monkeypatch.setattr(compose_module, "compose_affine", counting_compose)
    monkeypatch.setattr(rope_module, "rope_into", counting_rope)
    result = engine.prefill(request, mode)

    close = {"atol": RUNTIME_TOLERANCE, "rtol": RUNTIME_TOLERANCE}
    torch.testing.assert_close(result.logits, expected.logits, **close)
    for layer_index, state in expected.state.linear.items():
        torch.testing.assert_close(result.state.linear[layer_index].recurrent, state.recurrent, **close)
    for layer_index, state in expected.state.attention.items():
        torch.testing.assert_close(result.state.attention[layer_index].keys, state.keys, **close)
        torch.testing.assert_close(result.state.attention[layer_index].values, state.values, **close)

    model = engine.model
    linear_layers = model.layer_types.count("linear_attention")
    attention_layers = model.layer_types.count("full_attention")
    cached_spans = len(request.segments)  # the prefix and every chunk come from entries
    assert len(launches["rope"]) == attention_layers * cached_spans
    if mode == "hypic":  # a seam between every two cached remainders: one map per launch
        assert launches["compose"] == [1] * (linear_layers * cached_spans)
    else:  # no recomputed token between the cached spans: all of them in ONE launch per layer
        assert launches["compose"] == [cached_spans] * linear_layers
