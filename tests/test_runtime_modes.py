"""The runtime against transformers' own forward, and the six modes against `full`."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODES, UnknownModeError
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def random_request(generator: torch.Generator, chunk_lengths: list[int], prefix: int = 5, question: int = 6, vocab: int = 256) -> Request:
    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    return Request(ids(prefix) if prefix else [], [ids(n) for n in chunk_lengths], ids(question))


@pytest.fixture(scope="module", params=MODEL_TYPES)
def tiny(request):
    hf_model = build_tiny_model(request.param, seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    hf_model, engine = tiny
    request = random_request(torch.Generator().manual_seed(0), [23, 40, 17])
    ids = torch.tensor([request.all_ids()])
    expected = hf_model(ids, use_cache=False).logits[0, -1]
    result = engine.prefill(request, "full")
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)
    generation = engine.generate(request, "full", SamplingParams(max_new_tokens=16))
    expected_tokens = hf_model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert generation.token_ids == expected_tokens
    assert generation.finish_reason == "length"


def test_hypic_with_seam_covering_every_chunk_equals_full(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(1), [9, 13, 5, 11])
    full = engine.prefill(request, "full").logits
    hypic = engine.prefill(request, "hypic", seam_tokens=13)
    torch.testing.assert_close(hypic.logits, full, atol=1e-4, rtol=1e-4)
    # the recomputed set is then every token but the prefix (served exactly from its position-0 entry)
    assert hypic.stats.recomputed_tokens == request.prompt_tokens - len(request.prefix_ids)


def test_prefix_mode_equals_full_and_reuses_checkpoints(tiny) -> None:
    _, engine = tiny
    generator = torch.Generator().manual_seed(2)
    request = random_request(generator, [12, 20, 8])
    full = engine.prefill(request, "full").logits
    first = engine.prefill(request, "prefix")
    torch.testing.assert_close(first.logits, full, atol=1e-5, rtol=1e-5)
    assert first.stats.prefix_reused_tokens == 0
    # a second request sharing prefix + first two chunks reuses their exact boundary state
    second_request = Request(request.prefix_ids, request.chunk_ids[:2] + [[1, 2, 3, 4]], request.question_ids)
    second = engine.prefill(second_request, "prefix")
    assert second.stats.prefix_reused_tokens == len(request.prefix_ids) + 12 + 20
    torch.testing.assert_close(second.logits, engine.prefill(second_request, "full").logits, atol=1e-5, rtol=1e-5)
    # a different order defeats prefix reuse beyond the prefix
    shuffled = Request(request.prefix_ids, request.chunk_ids[::-1], request.question_ids)
    assert engine.prefill(shuffled, "prefix").stats.prefix_reused_tokens == len(request.prefix_ids)


@pytest.mark.parametrize("seam", [0, 2, 8])
def test_hypic_recomputes_only_seams_and_question(tiny, seam: int) -> None:
    """With a prefix at position 0, every chunk is not at position 0: recomputed = chunks x seam + question."""
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(4), [10, 3, 25, 6], prefix=5)
    result = engine.prefill(request, "hypic", seam_tokens=seam)
    expected = sum(min(seam, len(chunk)) for chunk in request.chunk_ids) + len(request.question_ids)
    assert result.stats.recomputed_tokens == expected
    # entries come from the cache (reused: cached_tokens) or are encoded by this prefill (encoded_tokens)
    assert result.stats.cached_tokens + result.stats.encoded_tokens == request.prompt_tokens - expected
    again = engine.prefill(request, "hypic", seam_tokens=seam).stats
    assert (again.cached_tokens, again.encoded_tokens, again.cache_misses) == (request.prompt_tokens - expected, 0, 0)
    # without a prefix the first chunk sits at position 0 and recomputes its seam from the zero start (exact)
    bare = Request([], request.chunk_ids, request.question_ids)
    assert engine.prefill(bare, "hypic", seam_tokens=seam).stats.recomputed_tokens == expected


def test_chunk_at_position_zero_is_exact_without_prefix(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(8), [14], prefix=0)
    full = engine.prefill(request, "full").logits
    for mode in ("transition", "transition_rope", "hypic", "addition"):
        torch.testing.assert_close(engine.prefill(request, mode).logits, full, atol=1e-5, rtol=1e-5)


def test_every_mode_runs_and_unknown_mode_is_rejected(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(5), [7, 7])
    for mode in MODES:
        assert torch.isfinite(engine.prefill(request, mode).logits).all()
    with pytest.raises(UnknownModeError, match="unknown mode 'fastest'"):
        engine.prefill(request, "fastest")


def test_sampling_is_seeded_and_stop_tokens_stop() -> None:
    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=0)))
    request = random_request(torch.Generator().manual_seed(6), [10])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    first = engine.generate(request, "hypic", params)
    assert first.token_ids == engine.generate(request, "hypic", params).token_ids
    greedy = engine.generate(request, "hypic", SamplingParams(max_new_tokens=8))
    stop_at = greedy.token_ids[2]
    stopped = engine.generate(request, "hypic", SamplingParams(max_new_tokens=8, stop_token_ids=(stop_at,)))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at)]


def _linear_only_engine(conv_kernel: int) -> tuple[object, Engine]:
    hf_model = build_tiny_model(
        "qwen3_5", seed=9, num_hidden_layers=1, layer_types=["linear_attention"], linear_conv_kernel_dim=conv_kernel
    )
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    _, engine = _linear_only_engine(conv_kernel=1)
    generator = torch.Generator().manual_seed(chunks)
    lengths = torch.randint(3, 30, (chunks,), generator=generator).tolist()
    request = random_request(generator, lengths, prefix=0)
    full = engine.prefill(request, "full")
    transition = engine.prefill(request, "transition")
    torch.testing.assert_close(transition.logits, full.logits, atol=1e-5, rtol=1e-5)
    for layer_index, state in full.state.linear.items():
        torch.testing.assert_close(transition.state.linear[layer_index].recurrent, state.recurrent, atol=1e-5, rtol=1e-5)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    _, engine = _linear_only_engine(conv_kernel=4)
    request = random_request(torch.Generator().manual_seed(12), [15, 22, 9, 30], prefix=0)
    full = engine.prefill(request, "full").logits
    transition = engine.prefill(request, "transition").logits
    hypic = engine.prefill(request, "hypic", seam_tokens=3).logits
    assert (transition - full).abs().max() > 1e-3  # the first 3 tokens of each chunk saw zeros in their conv
    torch.testing.assert_close(hypic, full, atol=1e-5, rtol=1e-5)


def test_single_attention_layer_needs_repositioning() -> None:
    hf_model = build_tiny_model("qwen3_5", seed=4, num_hidden_layers=1, layer_types=["full_attention"])
    engine = Engine(wrap_model(hf_model), seam_tokens=0)
    request = random_request(torch.Generator().manual_seed(3), [12, 18, 9], prefix=4)
    full = engine.prefill(request, "full").logits
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.prefill(request, "hypic").logits, full, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Mean KL(full || mode) over 20 random requests: hypic < transition_rope < addition."""
    hf_model = build_tiny_model("qwen3_5", seed=0, num_hidden_layers=8, initializer_range=0.1)
    engine = Engine(wrap_model(hf_model), seam_tokens=8)
    generator = torch.Generator().manual_seed(0)
    totals = {"hypic": 0.0, "transition_rope": 0.0, "addition": 0.0}
    for _ in range(20):
        count = int(torch.randint(2, 6, (1,), generator=generator))
        lengths = torch.randint(16, 48, (count,), generator=generator).tolist()
        request = random_request(generator, lengths, prefix=6, question=8)
        reference = engine.prefill(request, "full").logits
        for mode in totals:
            totals[mode] += kl_divergence(reference, engine.prefill(request, mode).logits) / 20
    assert totals["hypic"] < totals["transition_rope"] < totals["addition"], totals
