"""NVIDIA Nemotron-H (`nemotron_h`: one mixer per layer, Mamba2 / SSD with a clamped time step, NoPE attention,
MLP-only and MoE-only layers) through the mixer interface, against transformers' own forward and against `full` in
every mode that must be exact."""

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
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import ProjectedAttention
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model("nemotron_h", seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


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


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    check_full_matches_transformers(*tiny)


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


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_repositioning_is_a_no_op_without_rope(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits, transition, atol=1e-6, rtol=1e-6)


def test_entries_hold_a_scalar_transition_per_head_and_nothing_for_feed_forward_layers(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    heads, state, head_dim = config.mamba_num_heads, config.ssm_state_size, config.mamba_head_dim
    conv_dim = heads * head_dim + 2 * config.n_groups * state
    check_entry_shapes(engine, 0, transition=(heads, 1, 1), state=(heads, state, head_dim),
                       conv_tail=(conv_dim, config.conv_kernel - 1))
    entry = engine.encode_segment(list(range(30)), 4)
    assert not any(name.startswith(("layers.1.", "layers.5.")) for name in entry)  # MoE, MLP: no entry tensors
    assert tuple(entry[tensor_name(3, "key")].shape) == (config.num_key_value_heads, 30, config.head_dim)


def test_the_mamba2_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    """transformers' own decays (A = 1..H; dt in [0.001, 0.1]), so that `addition` (P = 1) visibly differs."""
    hf_model = build_tiny_model("nemotron_h", seed=9, num_hidden_layers=1, conv_kernel=conv_kernel, slow_decay=False)
    assert hf_model.config.layers_block_type == ["linear_attention"]
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    check_linear_only_transition_is_exact(_linear_only_engine(conv_kernel=1), chunks)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    check_conv_tail_needs_the_seam(_linear_only_engine(conv_kernel=4), seam=3)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Slow decays (A log-uniform in [0.005, 0.5]) and peaked NoPE attention (initializer_range 0.2): mean KL over
    20 requests, hypic < transition < addition."""
    hf_model = build_tiny_model("nemotron_h", seed=0, num_hidden_layers=8)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=False)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp("nemotron_h"), corpus_tokenizer(), kind="nemotron_h")


def test_the_stand_in_has_nemotron_hs_published_layout(published) -> None:
    directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["hybrid_override_pattern"] == "M-M*-M-M"
    assert "layers_block_type" not in config and "auto_map" in config
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "backbone.layers.0.mixer.dt_bias",
            "backbone.layers.1.mixer.up_proj.weight", "lm_head.weight"} <= names
    assert not any(name.startswith("model.") for name in names)


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types.count("mlp") == 3 and engine.model.family.model_types == ("nemotron_h",)
