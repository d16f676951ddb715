"""NVIDIA Nemotron-H (`nemotron_h`: one mixer per layer, Mamba2 / SSD with a clamped time step, NoPE attention,
MLP-only and MoE-only layers) through the mixer interface: what is particular to it (the checks every family passes:
test_every_family.py)."""

from __future__ import annotations

import torch
from family_modes import random_request
from ssm_checks import check_mamba2_entry_shapes, check_published_checkpoint_loads, published_layout

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "nemotron_h"


def test_blocks_follow_the_layer_pattern(tiny) -> None:
    hf_model, engine = tiny
    assert hf_model.config.hybrid_override_pattern == "MEM*M-"
    assert engine.model.layer_types == ("linear_attention", "mlp", "linear_attention", "full_attention",
                                        "linear_attention", "mlp")
    for block, layer in zip(engine.model.blocks, engine.model.runtime_model.model.layers):
        if layer.block_type == "linear_attention":
            # transformers' own limit: (time_step_min, inf) before 5.25, config.time_step_limit from 5.25
            assert isinstance(block.mixer, Mamba2Mixer)
            assert block.mixer.time_step_limit == tuple(float(value) for value in layer.mixer.time_step_limit)
        elif layer.block_type == "full_attention":
            assert isinstance(block.mixer, ProjectedAttention) and isinstance(block.mixer.positions, NoPositions)
        else:  # MLP / MoE layers: a feed-forward block alone
            assert block.mixers == () and block.mlp is layer.mixer and block.mlp_norm is layer.norm


def test_the_time_step_clamp_matches_transformers_forward_in_prefill_and_decode() -> None:
    """With dt_bias set so low that many steps fall under time_step_min, `full` still equals transformers' forward
    (which clamps); every decode step equals transformers' forward over the grown sequence (1e-4). transformers'
    own cached decode step does not clamp (docs/families_ssm.md, section 0): the runtime keeps the forward's
    arithmetic in every step, so a one-token step is the same function of the tokens as a prefill."""
    hf_model = build_tiny_model("nemotron_h", seed=5)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if layer.block_type == "linear_attention":
                layer.mixer.dt_bias.fill_(-7.0)
    engine = Engine(wrap_model(hf_model))
    request = random_request(torch.Generator().manual_seed(4), [20, 31])
    ids = request.all_ids()
    with torch.no_grad():
        raw = hf_model.model.layers[0].mixer.in_proj(hf_model.model.embeddings(torch.tensor([ids])))[..., -4:]
        clamped = (torch.nn.functional.softplus(raw + hf_model.model.layers[0].mixer.dt_bias) < 1e-3).float().mean()
    assert clamped > 0.3  # the clamp bites
    result = engine.prefill(request, "full")
    state, logits = result.state, result.logits
    for _ in range(4):
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids]), use_cache=False).logits[0, -1]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        token = int(logits.argmax())
        ids.append(token)
        logits, state = engine.decode_step(state, token)


def test_entries_hold_a_scalar_transition_per_head_and_nothing_for_feed_forward_layers(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    check_mamba2_entry_shapes(engine, 0, heads=config.mamba_num_heads, state=config.ssm_state_size,
                              head_dim=config.mamba_head_dim, groups=config.n_groups, conv_kernel=config.conv_kernel)
    entry = engine.encode_segment(list(range(30)), 4)
    assert not any(name.startswith(("layers.1.", "layers.5.")) for name in entry)  # MoE, MLP: no entry tensors
    assert tuple(entry[tensor_name(3, "key")].shape) == (config.num_key_value_heads, 30, config.head_dim)


def test_the_stand_in_has_nemotron_hs_published_layout(published) -> None:
    config, names = published_layout(published[0])
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["hybrid_override_pattern"] == "M-M*-M-M"
    assert "layers_block_type" not in config and "auto_map" in config
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.0.mixer.dt_bias",
            "backbone.layers.1.mixer.up_proj.weight", "lm_head.weight"} <= names
    assert not any(name.startswith("model.") for name in names)


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types.count("mlp") == 3 and engine.model.family.model_types == ("nemotron_h",)
