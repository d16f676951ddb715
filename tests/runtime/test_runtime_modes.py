"""The runtime against transformers' own forward, and the six modes against `full`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hypic_rag.pipeline.precompute import plan_segments
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODE_TABLE, MODES, PREFIX_ENTRY_SEAM, UnknownModeError, entry_seams
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams, choose_token, sampling_generator, sampling_probabilities
from hypic_rag.runtime.segment_source import MemorySegmentSource
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")




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


# ------------------------------------------------------------------------------------------------ the mode table
class RecordingSource(MemorySegmentSource):
    """The in-memory segment source, noting which (seam, segment) entries were asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[tuple[int, tuple[int, ...]]] = set()

    def get_many(self, seam_tokens, segments):
        self.asked.update((seam_tokens, tuple(segment)) for segment in segments)
        return super().get_many(seam_tokens, segments)


def test_the_mode_table_is_what_engine_bench_and_precompute_use(tiny) -> None:
    _, engine = tiny
    assert tuple(MODE_TABLE) == MODES
    expected = {  # mode: (chunk entry seam for w=5, reposition keys, composition) as docs/runtime.md lays out
        "full": (None, True, "transition"),
        "prefix": (None, True, "transition"),
        "addition": (0, False, "addition"),
        "transition": (0, False, "transition"),
        "transition_rope": (0, True, "transition"),
        "hypic": (5, True, "transition"),
    }
    assert {name: (spec.entry_seam(5), spec.reposition_keys, spec.composition)
            for name, spec in MODE_TABLE.items()} == expected
    assert entry_seams(MODES, 5) == {0, 5}  # what the benchmark warms
    request = random_request(torch.Generator().manual_seed(10), [9, 12, 9], prefix=4)
    for mode, spec in MODE_TABLE.items():
        source = RecordingSource()
        Engine(engine.model, seam_tokens=5, segment_source=source).prefill(request, mode)
        if not spec.uses_entries:
            assert source.asked == set(), mode
            continue
        seams = spec.segment_seams(5, has_prefix=True, segments=len(request.segments))
        assert seams[0] == PREFIX_ENTRY_SEAM and set(seams[1:]) == {spec.entry_seam(5)}
        assert source.asked == {(seam, tuple(segment)) for seam, segment in zip(seams, request.segments)}, mode
        if mode == "hypic":  # precompute plans exactly the entries a hypic request asks for
            plans = plan_segments(request.prefix_ids, request.chunk_ids, 5)
            assert {(plan.seam_tokens, tuple(ids)) for plan in plans for ids in plan.segments} == source.asked


@pytest.mark.parametrize("seam", [-1, True, 2.0, "8", 65_537, 2**70])
def test_every_seam_width_is_checked_by_the_one_validator(tiny, seam) -> None:
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.retrieval.corpus_index import IndexConfig
    from hypic_rag.retrieval.encoding_pool import EncoderConfig
    from hypic_rag.retrieval.manifest import ModelIdentity
    from hypic_rag.pipeline.precompute import PrecomputeConfig, SegmentPlan
    from hypic_rag.runtime.encode import encode_segment

    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(11), [6])
    message = "seam_tokens must be an integer in 0..65536"
    attempts = {
        "engine": lambda: Engine(engine.model, seam_tokens=seam),
        "prefill": lambda: engine.prefill(request, "hypic", seam_tokens=seam),
        "encode": lambda: encode_segment(engine.model, [1, 2, 3], seam),
        "namespace": lambda: CacheNamespace("m", "t", seam_tokens=seam),
        "settings": lambda: IndexConfig(ModelIdentity("p", "m", "t"), seam_tokens=seam),
        "options": lambda: PrecomputeConfig(Path("c"), Path("i"), Path("m"), seam_tokens=seam),
        "plan": lambda: SegmentPlan(seam, [[1]]),
        "encoder": lambda: EncoderConfig("p", "cpu", "float32", seam, "f"),
    }
    for name, attempt in attempts.items():  # every place refuses it, with the same message
        with pytest.raises(ValueError, match=message):
            attempt()


def test_sampling_lives_in_its_own_module() -> None:
    assert SamplingParams.__module__ == "hypic_rag.runtime.sampling"
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    assert choose_token(logits, SamplingParams(), sampling_generator(None)) == 1  # greedy at temperature 0
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [choose_token(logits, params, sampling_generator(3)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same seed, the same draw
    assert sampling_probabilities(logits, 1.0, 1.0).dtype == torch.float64
