"""AI21 Jamba (`jamba`: Mamba1 / selective scan with an elementwise transition, NoPE attention, MoE on odd layers)
through the mixer interface, against transformers' own forward and against `full` in every mode that must be exact."""

from __future__ import annotations

import json

import pytest
import torch
from ssm_checks import (
    check_conv_tail_needs_the_seam,
    check_deviation_ordering,
    check_entry_shapes,
    check_full_matches_transformers,
    check_linear_only_transition_is_exact,
    check_published_checkpoint_loads,
    check_seams_and_prefix_are_exact,
    corpus_tokenizer,
    random_request,
)

from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.mamba1 import Mamba1Mixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model("jamba", seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_mixers_and_positions(tiny) -> None:
    _, engine = tiny
    assert engine.model.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    for number, (block, layer) in enumerate(zip(engine.model.blocks, engine.model.runtime_model.model.layers)):
        if number == 2:
            assert isinstance(block.mixer, ProjectedAttention) and isinstance(block.mixer.positions, NoPositions)
        else:
            assert isinstance(block.mixer, Mamba1Mixer) and block.mixer.transition_kind == "vector"
        assert block.mlp is layer.feed_forward
        assert (type(block.mlp).__name__ == "JambaSparseMoeBlock") == (number % 2 == 1)


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    check_full_matches_transformers(*tiny)


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_repositioning_is_a_no_op_without_rope(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits, transition, atol=1e-6, rtol=1e-6)


def test_entries_hold_an_elementwise_transition_shaped_like_the_state(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    channels = config.mamba_expand * config.hidden_size
    shape = (channels, config.mamba_d_state)
    check_entry_shapes(engine, 0, transition=shape, state=shape, conv_tail=(channels, config.mamba_d_conv - 1))
    entry = engine.encode_segment(list(range(30)), 4)
    transition = entry["layers.0.transition"]
    assert bool(((transition > 0) & (transition < 1)).all())  # exp(A * sum dt) per channel and state entry
    assert tuple(entry["layers.2.key"].shape) == (config.num_key_value_heads, 30, 16)


def test_the_mamba1_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    hf_model = build_tiny_model("jamba", seed=9, num_hidden_layers=1, mamba_d_conv=conv_kernel)
    assert hf_model.config.layers_block_type == ["mamba"]
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    check_linear_only_transition_is_exact(_linear_only_engine(conv_kernel=1), chunks)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    check_conv_tail_needs_the_seam(_linear_only_engine(conv_kernel=4), seam=3)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Slow decays (A log-uniform in [0.005, 0.5]) and peaked NoPE attention (initializer_range 0.2): mean KL over
    20 requests, hypic < transition < addition."""
    hf_model = build_tiny_model("jamba", seed=0, num_hidden_layers=8)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=False)


@pytest.mark.parametrize("cache_format", ["float32", "int8"])
def test_entries_round_trip_through_the_segment_cache(tiny, tmp_path, cache_format: str) -> None:
    """Elementwise transitions stored in the LMDB cache (and compressed to int8 groups) serve the same request."""
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache

    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(7), [19, 26, 11])
    expected = engine.prefill(request, "hypic").logits
    namespace = CacheNamespace.for_model(engine.model, 4, cache_format=cache_format)
    served = {}
    for attempt in ("encode", "hit"):
        cache = SegmentCache.open(tmp_path / "cache", namespace=namespace)
        try:
            result = Engine(engine.model, seam_tokens=4, segment_source=cache).prefill(request, "hypic")
        finally:
            cache.close()
        assert (result.stats.cache_misses == 0) == (attempt == "hit")
        served[attempt] = result.logits
        if cache_format == "float32":
            torch.testing.assert_close(result.logits, expected, atol=1e-5, rtol=1e-5)
        else:  # 8-bit groups (conv tails grouped along their 128 channels): the format's promise, KL <= 1e-3 and
            # the same next token; elementwise logits move ~1.5% of their scale on this random model
            assert kl_divergence(expected, result.logits) < 1e-3
            assert int(result.logits.argmax()) == int(expected.argmax())
    # a miss composes the entries as stored, so the first request gets what every later hit gets
    torch.testing.assert_close(served["encode"], served["hit"], atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp("jamba"), corpus_tokenizer(), kind="jamba")


def test_the_stand_in_has_jambas_published_layout(published) -> None:
    directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["JambaForCausalLM"] and config["model_type"] == "jamba"
    assert config["attn_layer_period"] == 8 and config["attn_layer_offset"] == 4 and "auto_map" in config
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert "model.layers.1.feed_forward.experts.3.gate_proj.weight" in names  # per-expert, as published
    assert "model.layers.1.feed_forward.router.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    assert {"model.final_layernorm.weight", "model.layers.0.mamba.A_log", "lm_head.weight"} <= names


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types[4] == "full_attention" and engine.model.family.model_types == ("jamba",)

