"""Zyphra Zamba2 (`zamba2`: Mamba2 / SSD in every layer, a shared transformer block with per-layer adapters feeding
the Mamba input of hybrid layers, fed with the token embeddings; NoPE or RoPE) through the mixer interface: what is
particular to it (the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import pytest
from family_modes import tiny_engine
from ssm_checks import check_mamba2_entry_shapes, check_published_checkpoint_loads, published_layout

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.families.zamba2 import HybridBlock
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer

MODEL_TYPE = "zamba2"


@pytest.fixture(scope="module", params=["nope", "rope"])
def tiny(request):
    return tiny_engine("zamba2", use_mem_rope=request.param == "rope")


def test_hybrid_blocks_share_the_attention_weights_with_their_own_adapters(tiny) -> None:
    hf_model, engine = tiny
    assert engine.model.layer_types == ("linear_attention", "linear_attention+full_attention") * 2
    first, second = engine.model.blocks[1], engine.model.blocks[3]
    assert isinstance(first, HybridBlock) and isinstance(second, HybridBlock)
    assert first.attention_mixer.module.q_proj.weight is second.attention_mixer.module.q_proj.weight  # tied
    assert (first.attention_mixer.adapter_index, second.attention_mixer.adapter_index) == (0, 1)
    assert isinstance(engine.model.blocks[0].mixer, Mamba2Mixer)
    rope = hf_model.config.use_mem_rope
    assert isinstance(first.attention_mixer.positions, RotaryPositions if rope else NoPositions)


def test_each_hybrid_layer_caches_its_own_keys(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    check_mamba2_entry_shapes(engine, 1, heads=config.n_mamba_heads, state=config.mamba_d_state,
                              head_dim=config.mamba_headdim, groups=config.mamba_ngroups,
                              conv_kernel=config.mamba_d_conv)
    entry = engine.encode_segment(list(range(30)), 4)
    keys = [entry[tensor_name(layer, "key")] for layer in (1, 3)]
    assert tuple(keys[0].shape) == (config.num_key_value_heads, 30, config.attention_head_dim)
    assert (keys[0] - keys[1]).abs().max() > 1e-3  # same weights, other inputs and adapters
    assert tensor_name(0, "key") not in entry and tensor_name(2, "key") not in entry


def test_the_stand_in_has_zamba2s_published_layout(published) -> None:
    config, names = published_layout(published[0])
    assert config["architectures"] == ["Zamba2ForCausalLM"] and config["num_mem_blocks"] == 2
    assert config["layers_block_type"][:2] == ["mamba", "hybrid"] and "tie_word_embeddings" not in config
    assert {"model.layers.1.shared_transformer.self_attn.q_proj.weight", "model.layers.1.linear.weight",
            "model.layers.5.linear.weight", "model.layers.1.mamba_decoder.mamba.A_log",
            "model.layers.0.mamba.A_log", "model.final_layernorm.weight"} <= names
    assert not any(name.startswith("model.layers.5.shared_transformer") for name in names)  # tied to layer 1's
    assert "lm_head.weight" not in names  # tied to the embeddings


def test_a_published_checkpoint_loads_and_answers(published) -> None:
    directory, instance = published
    engine = check_published_checkpoint_loads(directory, instance)
    weights = [block.attention_mixer.module.q_proj.weight for block in engine.model.blocks[1::2]]
    assert weights[0] is weights[2] and weights[0] is not weights[1]  # two memory blocks: the ties survived loading
