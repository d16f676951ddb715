"""kimi_linear on the mixer interface: KDA linear layers and MLA without RoPE, against transformers' forward and `full`
(tiny random fp32 models; the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import torch
from family_modes import random_request

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.blocks import ResidualBlock
from hypic_rag.runtime.mixers.kda import KdaMixer
from hypic_rag.runtime.mixers.latent_attention import LatentAttention

MODEL_TYPE = "kimi_linear"


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert engine.model.layer_types == tuple(hf_model.config.layer_types)
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block, ResidualBlock)
        assert isinstance(block.mixer, KdaMixer if kind == "linear_attention" else LatentAttention)
        if kind == "full_attention":
            assert not block.mixer.positions.moves_keys  # Kimi's MLA has no RoPE


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
