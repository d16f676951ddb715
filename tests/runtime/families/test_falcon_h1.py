"""TII Falcon-H1 (`falcon_h1`: Mamba2 / SSD and RoPE attention side by side in every layer, muP multipliers, an
optional gated norm) through the mixer interface: what is particular to it (the checks every family passes:
test_every_family.py)."""

from __future__ import annotations

import pytest
import torch
from family_modes import random_request
from ssm_checks import check_mamba2_entry_shapes, check_published_checkpoint_loads, published_layout

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.blocks import ParallelBlock
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.falcon_h1 import FalconH1Mamba2Mixer, KeyScaledAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "falcon_h1"


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


def test_every_layer_caches_a_linear_state_and_keys(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    check_mamba2_entry_shapes(engine, 3, heads=config.mamba_n_heads, state=config.mamba_d_state,
                              head_dim=config.mamba_expand * config.hidden_size // config.mamba_n_heads,
                              groups=config.mamba_n_groups, conv_kernel=config.mamba_d_conv)
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


def test_the_stand_in_has_falcon_h1s_published_layout(published) -> None:
    config, names = published_layout(published[0])
    assert config["architectures"] == ["FalconH1ForCausalLM"] and config["rope_theta"] == 1e11
    assert len(config["ssm_multipliers"]) == 5 and config["mamba_d_ssm"] == 96
    assert {"model.layers.0.mamba.in_proj.weight", "model.layers.0.mamba.norm.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.final_layernorm.weight"} <= names
    assert not any("mup_vector" in name for name in names)  # a buffer rebuilt from the config


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.family.model_types == ("falcon_h1",)
