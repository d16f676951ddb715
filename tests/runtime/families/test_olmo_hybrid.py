"""olmo_hybrid on the mixer interface: Gated DeltaNet with b in [0, 2] and post-norm NoPE attention (RoPE when the
config sets a theta), against transformers' forward and `full` (checks in family_modes.py)."""

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

from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families import family_for
from hypic_rag.runtime.families.olmo_hybrid import OlmoHybrid, PostNormBlock
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.olmo_hybrid import OlmoGatedDeltaNetMixer, WholeNormAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "olmo_hybrid"
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model(MODEL_TYPE, seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert isinstance(family_for(MODEL_TYPE), OlmoHybrid)
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        if kind == "linear_attention":
            assert isinstance(block.mixer, OlmoGatedDeltaNetMixer)
        else:
            assert isinstance(block, PostNormBlock) and isinstance(block.mixer, WholeNormAttention)
            assert isinstance(block.mixer.positions, NoPositions)  # released checkpoints: no rope_theta


def test_full_matches_transformers(tiny) -> None:
    hf_model, engine = tiny
    assert hf_model.config.linear_allow_neg_eigval  # b in [0, 2] is what runs
    check_full_matches_transformers(hf_model, engine)


def test_hypic_with_wide_seams_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_without_rope_transition_rope_is_transition(tiny) -> None:
    request = random_request(torch.Generator().manual_seed(7), [12, 20, 9])
    engine = tiny[1]
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits,
                               engine.prefill(request, "transition").logits, atol=1e-6, rtol=1e-6)


def test_with_rope_full_matches_transformers_and_seams_are_exact() -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=5, **ROPE)
    engine = Engine(wrap_model(hf_model), seam_tokens=4)
    attention = engine.model.blocks[hf_model.config.layer_types.index("full_attention")].mixer
    assert isinstance(attention.positions, RotaryPositions)
    check_full_matches_transformers(hf_model, engine, seed=4)
    check_seams_and_prefix_are_exact(engine, seed=5)


def test_gated_deltanet_meets_the_mixer_contract(tiny) -> None:
    hf_model, engine = tiny
    x = torch.randn(37, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=13)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    # OLMo's config refuses a stack without attention: build [linear, attention] and keep the linear layer only
    hf_model = build_tiny_model(MODEL_TYPE, seed=9, num_hidden_layers=2,
                                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=1)
    del hf_model.model.layers[1]
    check_linear_only_transition_is_exact(Engine(wrap_model(hf_model), seam_tokens=3), chunks)


def test_deviation_from_full_is_ordered() -> None:
    # transformers' own init scale (0.02): at 0.1 (the other families' test models) this 8-layer stack is chaotic,
    # every mode's mean KL is ~0.5 and hypic vs transition is within the requests' noise (docs/families_linear.md)
    hf_model = build_tiny_model(MODEL_TYPE, seed=0, num_hidden_layers=8, initializer_range=0.02)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=False)
