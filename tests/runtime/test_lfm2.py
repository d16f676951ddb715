"""LiquidAI LFM2 (`lfm2`: gated short convolutions without a recurrent state, RoPE attention with q/k layer norms)
through the mixer interface: the stateless recurrent-mixer path (entries hold only conv tails)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.entry import tensor_name
from hypic_rag.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.short_conv import ShortConvMixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model


def random_request(generator: torch.Generator, chunk_lengths: list[int], prefix: int = 5, question: int = 6) -> Request:
    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    return Request(ids(prefix) if prefix else [], [ids(n) for n in chunk_lengths], ids(question))


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model("lfm2", seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    hf_model, engine = tiny
    request = random_request(torch.Generator().manual_seed(0), [23, 40, 17])
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = hf_model(ids, use_cache=False).logits[0, -1]
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)
    generation = engine.generate(request, "full", SamplingParams(max_new_tokens=16))
    assert generation.token_ids == hf_model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(1), [9, 13, 5, 11])
    full = engine.prefill(request, "full").logits
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=13).logits, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(request, "prefix").logits, full, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition_rope").logits - full).abs().max() > 1e-3


def test_entries_hold_only_conv_tails_for_conv_layers(tiny) -> None:
    hf_model, engine = tiny
    entry = engine.encode_segment(list(range(20)), 4)
    conv_layers = [i for i, kind in enumerate(hf_model.config.layer_types) if kind == "conv"]
    for index in conv_layers:
        assert tuple(entry[tensor_name(index, "conv_tail")].shape) == (64, 2)
        assert tensor_name(index, "transition") not in entry and tensor_name(index, "suffix_state") not in entry
    assert isinstance(engine.model.blocks[conv_layers[0]].mixer, ShortConvMixer)
    check_recurrent_mixer(engine.model.blocks[conv_layers[0]].mixer, torch.randn(19, 64), split=7)


def test_conv_only_models_compose_from_tails_alone() -> None:
    """Without a recurrent state, a chunk's entry is exact past its first (kernel-1) x depth tokens. One conv layer:
    `transition` equals `full` (kernel 1 or 3) and leaves the same conv tails. Two layers with a 2-token chunk right
    before a 1-token question: the chunk's tail was convolved against zeros, so only the seam repairs it."""
    generator = torch.Generator().manual_seed(6)
    request = random_request(generator, [7, 12, 9, 15], prefix=0)
    for kernel in (1, 3):
        hf_model = build_tiny_model("lfm2", seed=9, num_hidden_layers=1, layer_types=["conv"], conv_L_cache=kernel)
        engine = Engine(wrap_model(hf_model), seam_tokens=kernel - 1)
        full, transition = engine.prefill(request, "full"), engine.prefill(request, "transition")
        torch.testing.assert_close(transition.logits, full.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(transition.state.linear[0].conv_tail, full.state.linear[0].conv_tail)
    hf_model = build_tiny_model("lfm2", seed=9, num_hidden_layers=2, layer_types=["conv", "conv"], conv_L_cache=3)
    engine = Engine(wrap_model(hf_model), seam_tokens=2)
    request = random_request(generator, [7, 2], prefix=0, question=1)
    full = engine.prefill(request, "full").logits
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3
    torch.testing.assert_close(engine.prefill(request, "hypic").logits, full, atol=1e-5, rtol=1e-5)
