"""olmo_hybrid on the mixer interface: Gated DeltaNet with b in [0, 2] and post-norm NoPE attention (RoPE when the
config sets a theta), against transformers' forward and `full` (the checks every family passes:
test_every_family.py)."""

from __future__ import annotations

import torch
from family_modes import check_full_matches_transformers, check_seams_and_prefix_are_exact, random_request

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families.olmo_hybrid import PostNormBlock
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.olmo_hybrid import OlmoGatedDeltaNetMixer, WholeNormAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "olmo_hybrid"
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert hf_model.config.linear_allow_neg_eigval  # b in [0, 2] is what runs
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        if kind == "linear_attention":
            assert isinstance(block.mixer, OlmoGatedDeltaNetMixer)
        else:
            assert isinstance(block, PostNormBlock) and isinstance(block.mixer, WholeNormAttention)
            assert isinstance(block.mixer.positions, NoPositions)  # released checkpoints: no rope_theta


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
