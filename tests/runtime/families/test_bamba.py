"""IBM Bamba (`bamba`: Mamba2 / SSD with a scalar transition per head, attention with partial RoPE, SwiGLU MLP)
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
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model("bamba", seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_mixers_and_partial_rope(tiny) -> None:
    _, engine = tiny
    assert engine.model.layer_types == ("linear_attention", "linear_attention", "full_attention", "linear_attention")
    for number, block in enumerate(engine.model.blocks):
        assert isinstance(block.mixer, ProjectedAttention if number == 2 else Mamba2Mixer)
    positions = engine.model.blocks[2].mixer.positions
    assert isinstance(positions, RotaryPositions)
    cos, _ = positions.tables(torch.arange(5), torch.zeros(1))
    assert cos.shape[-1] == 8  # half of each 16-dim head rotates (partial_rotary_factor 0.5)


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    check_full_matches_transformers(*tiny)


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_repositioning_moves_the_cached_keys(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    assert (engine.prefill(request, "transition_rope").logits - transition).abs().max() > 1e-4


def test_entries_hold_a_scalar_transition_per_head(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    heads, state, head_dim = config.mamba_n_heads, config.mamba_d_state, config.mamba_d_head
    conv_dim = config.mamba_expand * config.hidden_size + 2 * config.mamba_n_groups * state
    check_entry_shapes(engine, 0, transition=(heads, 1, 1), state=(heads, state, head_dim),
                       conv_tail=(conv_dim, config.mamba_d_conv - 1))


def test_the_mamba2_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    hf_model = build_tiny_model("bamba", seed=9, num_hidden_layers=1, mamba_d_conv=conv_kernel)
    assert hf_model.config.layers_block_type == ["linear_attention"]
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    check_linear_only_transition_is_exact(_linear_only_engine(conv_kernel=1), chunks)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    check_conv_tail_needs_the_seam(_linear_only_engine(conv_kernel=4), seam=3)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Slow decays (A log-uniform in [0.005, 0.5]) and peaked attention (initializer_range 0.2): mean KL over 20
    requests, hypic < transition_rope < addition."""
    hf_model = build_tiny_model("bamba", seed=0, num_hidden_layers=8)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=True)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp("bamba"), corpus_tokenizer(), kind="bamba")


def test_the_stand_in_has_bambas_published_layout(published) -> None:
    directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["BambaForCausalLM"] and config["attn_layer_indices"] == [3, 6]
    assert "rope_theta" in config and "rope_parameters" not in config
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
    assert {"model.layers.0.mamba.dt_bias", "model.layers.0.mamba.norm.weight", "model.final_layernorm.weight",
            "model.layers.3.self_attn.q_proj.weight", "model.layers.3.feed_forward.gate_proj.weight"} <= names


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    assert engine.model.layer_types.count("full_attention") == 2 and engine.model.family.model_types == ("bamba",)
