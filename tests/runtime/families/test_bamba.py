"""IBM Bamba (`bamba`: Mamba2 / SSD with a scalar transition per head, attention with partial RoPE, SwiGLU MLP)
through the mixer interface: what is particular to it (the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import torch
from ssm_checks import check_mamba2_entry_shapes, check_published_checkpoint_loads, published_layout

from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer

MODEL_TYPE = "bamba"


def test_blocks_mixers_and_partial_rope(tiny) -> None:
    _, engine = tiny
    assert engine.model.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    for number, block in enumerate(engine.model.blocks):
        assert isinstance(block.mixer, ProjectedAttention if number == 2 else Mamba2Mixer)
    positions = engine.model.blocks[2].mixer.positions
    assert isinstance(positions, RotaryPositions)
    cos, _ = positions.tables(torch.arange(5), torch.zeros(1))
    assert cos.shape[-1] == 8  # half of each 16-dim head rotates (partial_rotary_factor 0.5)


def test_entries_hold_a_scalar_transition_per_head(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size
    check_mamba2_entry_shapes(engine, 0, heads=config.mamba_n_heads, state=config.mamba_d_state,
                              head_dim=config.mamba_d_head, groups=config.mamba_n_groups,
                              conv_kernel=config.mamba_d_conv)


def test_the_stand_in_has_bambas_published_layout(published) -> None:
    config, names = published_layout(published[0])
    assert config["architectures"] == ["BambaForCausalLM"] and config["attn_layer_indices"] == [3, 6]
    assert "rope_theta" in config and "rope_parameters" not in config
    assert {"model.layers.0.mamba.dt_bias", "model.layers.0.mamba.norm.weight", "model.final_layernorm.weight",
            "model.layers.3.self_attn.q_proj.weight", "model.layers.3.feed_forward.gate_proj.weight"} <= names


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types.count("full_attention") == 2 and engine.model.family.model_types == ("bamba",)
