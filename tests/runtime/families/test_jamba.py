"""AI21 Jamba (`jamba`: Mamba1 / selective scan with an elementwise transition, NoPE attention, MoE on odd layers)
through the mixer interface: what is particular to it (the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import pytest
import torch
from ssm_checks import (
    check_entry_shapes,
    check_published_checkpoint_loads,
    published_layout,
    served_from_a_segment_cache,
)

from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.mamba1 import Mamba1Mixer

MODEL_TYPE = "jamba"


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


@pytest.mark.parametrize("cache_format", ["float32", "int8"])
def test_entries_round_trip_through_the_segment_cache(tiny, tmp_path, cache_format: str) -> None:
    """Elementwise transitions stored in the LMDB cache (and compressed to int8 groups) serve the same request."""
    expected, served = served_from_a_segment_cache(tiny[1], tmp_path / "cache", cache_format)
    for logits in served.values():
        if cache_format == "float32":
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        else:  # 8-bit groups (conv tails grouped along their 128 channels): the format's promise, KL <= 1e-3 and
            # the same next token; elementwise logits move ~1.5% of their scale on this random model
            assert kl_divergence(expected, logits) < 1e-3
            assert int(logits.argmax()) == int(expected.argmax())
    # a miss composes the entries as stored, so the first request gets what every later hit gets
    torch.testing.assert_close(served["encode"], served["hit"], atol=1e-6, rtol=1e-6)


def test_the_stand_in_has_jambas_published_layout(published) -> None:
    config, names = published_layout(published[0])
    assert config["architectures"] == ["JambaForCausalLM"] and config["model_type"] == "jamba"
    assert config["attn_layer_period"] == 8 and config["attn_layer_offset"] == 4 and "auto_map" in config
    assert "model.layers.1.feed_forward.experts.3.gate_proj.weight" in names  # per-expert, as published
    assert "model.layers.1.feed_forward.router.weight" in names
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    assert {"model.final_layernorm.weight", "model.layers.0.mamba.A_log", "lm_head.weight"} <= names


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types[4] == "full_attention" and engine.model.family.model_types == ("jamba",)

