"""kimi_linear on the mixer interface: KDA linear layers and MLA without RoPE, against transformers' forward and
`full` (tiny random fp32 models; checks in family_modes.py)."""

from __future__ import annotations

import pytest
import torch
from family_modes import (
    check_deviation_ordering,
    check_full_matches_transformers,
    check_linear_only_transition_is_exact,
    check_seams_and_prefix_are_exact,
    random_request,
)

from hypic_rag.entry.schema import tensor_name
from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.blocks import ResidualBlock
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families import family_for
from hypic_rag.runtime.families.kimi_linear import KimiLinear
from hypic_rag.runtime.mixers.kda import KdaMixer
from hypic_rag.runtime.mixers.latent_attention import LatentAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "kimi_linear"


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model(MODEL_TYPE, seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert isinstance(family_for(MODEL_TYPE), KimiLinear)
    assert engine.model.layer_types == tuple(hf_model.config.layer_types)
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block, ResidualBlock)
        assert isinstance(block.mixer, KdaMixer if kind == "linear_attention" else LatentAttention)
        if kind == "full_attention":
            assert not block.mixer.positions.moves_keys  # Kimi's MLA has no RoPE


def test_full_matches_transformers(tiny) -> None:
    hf_model, engine = tiny
    check_full_matches_transformers(hf_model, engine)


def test_hypic_with_wide_seams_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_entries_hold_the_latent_and_transition_rope_is_transition(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    entry = engine.encode_segment(list(range(11)), seam_tokens=3)
    attention = config.layer_types.index("full_attention")
    assert entry[tensor_name(attention, "key")].shape == (1, 11, config.kv_lora_rank + config.qk_rope_head_dim)
    assert entry[tensor_name(attention, "value")].shape == (1, 11, config.kv_lora_rank)
    heads, head_dim = config.linear_num_heads, config.linear_head_dim
    assert entry[tensor_name(0, "transition")].shape == (heads, head_dim, head_dim)
    assert entry[tensor_name(0, "suffix_state")].shape == (heads, head_dim, head_dim)
    assert entry[tensor_name(0, "conv_tail")].shape == (3 * heads * head_dim, config.linear_conv_kernel_dim - 1)
    request = random_request(torch.Generator().manual_seed(7), [12, 20, 9])
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits,
                               engine.prefill(request, "transition").logits, atol=1e-6, rtol=1e-6)


def test_kda_meets_the_mixer_contract(tiny) -> None:
    hf_model, engine = tiny
    mixer = engine.model.blocks[0].mixer
    x = torch.randn(37, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    check_recurrent_mixer(mixer, x, split=13)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=9, num_hidden_layers=1, layer_types=["linear_attention"],
                                linear_conv_kernel_dim=1)
    check_linear_only_transition_is_exact(Engine(wrap_model(hf_model), seam_tokens=3), chunks)


def test_deviation_from_full_is_ordered() -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=0, num_hidden_layers=8, initializer_range=0.1)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=False)
