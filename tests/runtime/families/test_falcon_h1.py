"""TII Falcon-H1 (`falcon_h1`: Mamba2 / SSD and RoPE attention side by side in every layer, muP multipliers, an
optional gated norm) through the mixer interface, against transformers' own forward and against `full` in every
mode that must be exact."""

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

from hypic_rag.entry.schema import tensor_name
from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.blocks import ParallelBlock
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.falcon_h1 import FalconH1Mamba2Mixer, KeyScaledAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model("falcon_h1", seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_every_block_runs_both_mixers_with_their_multipliers(tiny) -> None:
    _, engine = tiny
    assert engine.model.layer_types == ("linear_attention+full_attention",) * 4
    for block in engine.model.blocks:
        assert isinstance(block, ParallelBlock)
        mamba, attention = block.branches
        assert isinstance(mamba.mixer, FalconH1Mamba2Mixer) and isinstance(attention.mixer, KeyScaledAttention)
        assert (mamba.input_multiplier, mamba.output_multiplier) == pytest.approx((1.2, 0.8))
        assert (attention.input_multiplier, attention.output_multiplier) == pytest.approx((1.1, 0.9))
        assert isinstance(attention.mixer.positions, RotaryPositions)


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    check_full_matches_transformers(*tiny)


@pytest.mark.parametrize("norm", ["none", "gate_then_normalise"])
def test_the_other_gate_variants_match_transformers(norm: str) -> None:
    """`mamba_rms_norm=False` (y * silu(z), the published 0.5B) and normalise-after-gate (the published 1.5B)."""
    options = {"mamba_rms_norm": False} if norm == "none" else {"mamba_norm_before_gate": False}
    hf_model = build_tiny_model("falcon_h1", seed=4, num_hidden_layers=2, **options)
    engine = Engine(wrap_model(hf_model))
    request = random_request(torch.Generator().manual_seed(3), [17, 25])
    with torch.no_grad():
        expected = hf_model(torch.tensor([request.all_ids()]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_repositioning_moves_the_cached_keys(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    assert (engine.prefill(request, "transition_rope").logits - transition).abs().max() > 1e-4


def test_every_layer_caches_a_linear_state_and_keys(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    heads, state = config.mamba_n_heads, config.mamba_d_state
    head_dim = config.mamba_expand * config.hidden_size // heads
    conv_dim = heads * head_dim + 2 * config.mamba_n_groups * state
    check_entry_shapes(engine, 3, transition=(heads, 1, 1), state=(heads, state, head_dim),
                       conv_tail=(conv_dim, config.mamba_d_conv - 1))
    entry = engine.encode_segment(list(range(30)), 4)
    for layer in range(4):
        assert tuple(entry[tensor_name(layer, "key")].shape) == (config.num_key_value_heads, 30, config.head_dim)
        assert tensor_name(layer, "suffix_state") in entry


def test_cached_keys_carry_the_key_multiplier(tiny) -> None:
    hf_model, engine = tiny
    attention = hf_model.model.layers[0].self_attn
    entry = engine.encode_segment(list(range(12)), 0)
    with torch.no_grad():
        normed = hf_model.model.layers[0].input_layernorm(engine.model.embed(torch.arange(12)))
        keys = attention.k_proj(normed * 1.1).view(12, -1, 16).transpose(0, 1) * 0.7
    torch.testing.assert_close(entry[tensor_name(0, "key")], keys, atol=1e-5, rtol=1e-5)


def test_the_mamba2_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].branches[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    """One layer whose attention branch is switched off (attention_out_multiplier 0: Falcon-H1 has no layer without
    attention), so the layer is its Mamba2 mixer alone."""
    hf_model = build_tiny_model("falcon_h1", seed=9, num_hidden_layers=1, mamba_d_conv=conv_kernel,
                                attention_out_multiplier=0.0)
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    check_linear_only_transition_is_exact(_linear_only_engine(conv_kernel=1), chunks)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    check_conv_tail_needs_the_seam(_linear_only_engine(conv_kernel=4), seam=3)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Slow decays (A log-uniform in [0.005, 0.5]) and peaked attention (initializer_range 0.2): mean KL over 20
    requests, hypic < transition_rope < addition."""
    hf_model = build_tiny_model("falcon_h1", seed=0, num_hidden_layers=6)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=True)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp("falcon_h1"), corpus_tokenizer(), kind="falcon_h1")


def test_the_stand_in_has_falcon_h1s_published_layout(published) -> None:
    directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["FalconH1ForCausalLM"] and config["rope_theta"] == 1e11
    assert len(config["ssm_multipliers"]) == 5 and config["mamba_d_ssm"] == 96
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.norm.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.final_layernorm.weight"} <= names
    assert not any("mup_vector" in name for name in names)  # a buffer rebuilt from the config


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.family.model_types == ("falcon_h1",)
