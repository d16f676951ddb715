"""The runtime driven through the Triton kernels (HYPIC_RAG_KERNELS=triton; on CPU under the interpreter) equals its
torch code (`ops.backends.use_triton` off) in every mode that composes cached entries, for one family of each
transition kind: matrix P (Gated DeltaNet, KDA), scalar P per head (SSD, lightning), elementwise P (Mamba1)."""

from __future__ import annotations

import pytest
import torch

import hypic_rag.kernels.compose as compose_module
import hypic_rag.kernels.compose_elementwise as elementwise_module
import hypic_rag.kernels.rope as rope_module
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.ops import backends
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model
from kernel_support import DEVICE, RUNTIME_TOLERANCE

COMPOSED_MODES = ("addition", "transition", "transition_rope", "hypic")
FAMILIES = {  # model type -> the transition kind of its linear layers
    "qwen3_5": "matrix", "qwen3_next": "matrix", "kimi_linear": "matrix",
    "bamba": "scalar", "minimax": "scalar", "jamba": "vector",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[str, Engine]:
    """(tiny model type, an engine over it)."""
    model = wrap_model(build_tiny_model(request.param, seed=4, num_hidden_layers=4).to(DEVICE))
    return request.param, Engine(model, seam_tokens=3)


def random_request(seed: int) -> Request:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    return Request(ids(4), [ids(n) for n in (11, 7, 16, 9)], ids(5))


@pytest.mark.parametrize("mode", COMPOSED_MODES)
def test_kernel_path_equals_torch_path(family: tuple[str, Engine], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, engine = family
    request = random_request(0)
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "triton")  # on CPU through the interpreter; fla (GPU) in both runs
    with monkeypatch.context() as torch_path:  # our kernels off: the torch code
        torch_path.setattr(backends, "use_triton", lambda tensor: False)
        expected = engine.prefill(request, mode)

    launches: dict[str, list[int]] = {"compose": [], "rope": []}

    def counting(module, name: str, key: str, size) -> None:
        real = getattr(module, name)

        def counted(*args, **options):
            launches[key].append(size(*args))
            return real(*args, **options)

        monkeypatch.setattr(module, name, counted)

    counting(compose_module, "compose_affine_batched", "compose", lambda start, transitions, states, counts: states.shape[0])
    counting(elementwise_module, "compose_elementwise_batched", "compose",
             lambda start, transitions, states, counts: states.shape[0])
    counting(rope_module, "rope_into", "rope", lambda out, at, keys, cos, sin, position: keys.shape[1])
    result = engine.prefill(request, mode)

    close = {"atol": RUNTIME_TOLERANCE, "rtol": RUNTIME_TOLERANCE}
    torch.testing.assert_close(result.logits, expected.logits, **close)
    for layer_index, state in expected.state.linear.items():
        torch.testing.assert_close(result.state.linear[layer_index].recurrent, state.recurrent, **close)
        torch.testing.assert_close(result.state.linear[layer_index].conv_tail, state.conv_tail, **close)
    for layer_index, state in expected.state.attention.items():
        torch.testing.assert_close(result.state.attention[layer_index].keys, state.keys, **close)
        torch.testing.assert_close(result.state.attention[layer_index].values, state.values, **close)

    blocks = engine.model.blocks
    recurrent_layers = sum(1 for b in blocks if b.recurrent is not None and b.recurrent.transition_kind is not None)
    rotary_layers = sum(1 for b in blocks if b.attention is not None and isinstance(b.attention.positions, RotaryPositions))
    assert recurrent_layers > 0
    cached_spans = len(request.segments)  # the prefix and every chunk come from entries
    assert len(launches["rope"]) == rotary_layers * cached_spans
    if mode == "hypic":  # a seam between every two cached remainders: one map per launch
        assert launches["compose"] == [1] * (recurrent_layers * cached_spans)
    else:  # no recomputed token between the cached spans: all of them in ONE launch per layer
        assert launches["compose"] == [cached_spans] * recurrent_layers


def test_the_families_cover_every_transition_kind(family: tuple[str, Engine]) -> None:
    model_type, engine = family
    kinds = {b.recurrent.transition_kind for b in engine.model.blocks if b.recurrent is not None}
    assert kinds == {FAMILIES[model_type]}
