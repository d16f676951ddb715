"""bailing_hybrid (Ling 3) on the mixer interface: KDA with the bounded gate, MLA with interleaved RoPE on its shared
key part and a per-head output gate, against transformers' forward and `full` (checks in family_modes.py)."""

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
from hypic_rag.runtime.families.bailing_hybrid import BailingHybrid
from hypic_rag.runtime.mixers.kda import KdaMixer
from hypic_rag.runtime.mixers.latent_attention import InterleavedTailRotary, LatentAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "bailing_hybrid"


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model(MODEL_TYPE, seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert isinstance(family_for(MODEL_TYPE), BailingHybrid)
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block.mixer, KdaMixer if kind == "linear_attention" else LatentAttention)
        if kind == "full_attention":
            assert isinstance(block.mixer.positions, InterleavedTailRotary)
            assert block.mixer.positions.rotary_dim == hf_model.config.qk_rope_head_dim


def test_full_matches_transformers(tiny) -> None:
    hf_model, engine = tiny
    check_full_matches_transformers(hf_model, engine)


def test_hypic_with_wide_seams_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_kda_meets_the_mixer_contract(tiny) -> None:
    hf_model, engine = tiny
    x = torch.randn(37, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=13)


def test_a_single_mla_layer_is_exact_once_its_rope_part_is_repositioned() -> None:
    """One MLA layer: cached latents with their rope part rotated at the true positions (interleaved pairs) are the
    in-context ones, so `transition_rope` is exact; left at their standalone positions they are not."""
    hf_model = build_tiny_model(MODEL_TYPE, seed=4, num_hidden_layers=1, layer_types=["full_attention"],
                                initializer_range=0.2)
    engine = Engine(wrap_model(hf_model), seam_tokens=0)
    request = random_request(torch.Generator().manual_seed(3), [12, 18, 9], prefix=4)
    full = engine.prefill(request, "full").logits
    torch.testing.assert_close(engine.prefill(request, "transition_rope").logits, full, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=9, num_hidden_layers=1, layer_types=["linear_attention"],
                                short_conv_kernel_size=1)
    check_linear_only_transition_is_exact(Engine(wrap_model(hf_model), seam_tokens=3), chunks)


def test_deviation_from_full_is_ordered() -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=0, num_hidden_layers=8, initializer_range=0.1)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=True)
