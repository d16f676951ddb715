"""minimax on the mixer interface: lightning attention (scalar transition) and RoPE softmax attention in DeepNorm-style
blocks, against transformers' forward and `full` (checks in family_modes.py)."""

from __future__ import annotations

import pytest
import torch
from family_modes import (
    check_deviation_ordering,
    check_full_matches_transformers,
    check_linear_only_transition_is_exact,
    check_seams_and_prefix_are_exact,
)

from hypic_rag.entry.schema import tensor_name
from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families import family_for
from hypic_rag.runtime.families.minimax import MiniMax, ScaledPostNormBlock
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.lightning import LightningMixer
from hypic_rag.runtime.model import UnsupportedModelError, load_model, wrap_model
from hypic_rag.runtime.ops.lightning import minimax_log_decay
from hypic_rag.testing import build_tiny_model, tiny_config

MODEL_TYPE = "minimax"


@pytest.fixture(scope="module")
def tiny():
    hf_model = build_tiny_model(MODEL_TYPE, seed=3)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert isinstance(family_for(MODEL_TYPE), MiniMax)
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block, ScaledPostNormBlock)
        assert isinstance(block.mixer, LightningMixer if kind == "linear_attention" else ProjectedAttention)
        if kind == "full_attention":
            assert isinstance(block.mixer.positions, RotaryPositions)


def test_full_matches_transformers(tiny) -> None:
    hf_model, engine = tiny
    check_full_matches_transformers(hf_model, engine)


def test_hypic_with_wide_seams_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_the_cached_transition_is_the_decay_over_the_suffix(tiny) -> None:
    """P of a lightning layer is exp(-s_h L) per head (L: the suffix length), whatever the tokens; no conv tail."""
    hf_model, engine = tiny
    config = hf_model.config
    entry = engine.encode_segment(list(range(30, 53)), seam_tokens=5)
    for layer_index, kind in enumerate(config.layer_types):
        if kind != "linear_attention":
            continue
        decay = minimax_log_decay(config.num_attention_heads, layer_index, config.num_hidden_layers)  # [H, 1]
        expected = (decay * (23 - 5)).exp()[:, :, None]
        torch.testing.assert_close(entry[tensor_name(layer_index, "transition")], expected, atol=1e-6, rtol=1e-5)
        assert entry[tensor_name(layer_index, "suffix_state")].shape == (config.num_attention_heads, 16, 16)
        assert entry[tensor_name(layer_index, "conv_tail")].numel() == 0


def test_lightning_meets_the_mixer_contract(tiny) -> None:
    hf_model, engine = tiny
    x = torch.randn(37, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=13)


def test_sliding_window_attention_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        load_model(tiny_config(MODEL_TYPE, sliding_window=64), device="cpu")


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact(chunks: int) -> None:
    """Lightning has no conv: one lightning layer composes cached chunks exactly."""
    hf_model = build_tiny_model(MODEL_TYPE, seed=9, num_hidden_layers=1, layer_types=["linear_attention"])
    check_linear_only_transition_is_exact(Engine(wrap_model(hf_model), seam_tokens=3), chunks)


def test_deviation_from_full_is_ordered() -> None:
    hf_model = build_tiny_model(MODEL_TYPE, seed=0, num_hidden_layers=8, initializer_range=0.1)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=True)
