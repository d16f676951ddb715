"""minimax on the mixer interface: lightning attention (scalar transition) and RoPE softmax attention in DeepNorm-style
blocks, against transformers' forward and `full` (the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.families.minimax import ScaledPostNormBlock
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.lightning import LightningMixer
from hypic_rag.runtime.model import UnsupportedModelError, load_model
from hypic_rag.runtime.ops.lightning import minimax_log_decay
from hypic_rag.testing import tiny_config

MODEL_TYPE = "minimax"


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block, ScaledPostNormBlock)
        assert isinstance(block.mixer, LightningMixer if kind == "linear_attention" else ProjectedAttention)
        if kind == "full_attention":
            assert isinstance(block.mixer.positions, RotaryPositions)


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


def test_sliding_window_attention_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        load_model(tiny_config(MODEL_TYPE, sliding_window=64), device="cpu")
