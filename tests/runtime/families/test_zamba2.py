"""Zyphra Zamba2 (`zamba2`: Mamba2 / SSD in every layer, a shared transformer block with per-layer adapters feeding
the Mamba input of hybrid layers, fed with the token embeddings; NoPE or RoPE) through the mixer interface, against
transformers' own forward and against `full` in every mode that must be exact."""

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
from hypic_rag.runtime.families.zamba2 import HybridBlock
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from hypic_rag.testing.ssm import save_published_ssm_checkpoint


@pytest.fixture(scope="module", params=["nope", "rope"])
def tiny(request):
    hf_model = build_tiny_model("zamba2", seed=3, use_mem_rope=request.param == "rope")
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


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


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    check_full_matches_transformers(*tiny)


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[1])


def test_repositioning_matters_only_with_rope(tiny) -> None:
    hf_model, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    transition_rope = engine.prefill(request, "transition_rope").logits
    if hf_model.config.use_mem_rope:
        assert (transition_rope - transition).abs().max() > 1e-4
    else:
        torch.testing.assert_close(transition_rope, transition, atol=1e-6, rtol=1e-6)


def test_each_hybrid_layer_caches_its_own_keys(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    heads, state, head_dim = config.n_mamba_heads, config.mamba_d_state, config.mamba_headdim
    conv_dim = heads * head_dim + 2 * config.mamba_ngroups * state
    check_entry_shapes(engine, 1, transition=(heads, 1, 1), state=(heads, state, head_dim),
                       conv_tail=(conv_dim, config.mamba_d_conv - 1))
    entry = engine.encode_segment(list(range(30)), 4)
    keys = [entry[tensor_name(layer, "key")] for layer in (1, 3)]
    assert tuple(keys[0].shape) == (config.num_key_value_heads, 30, config.attention_head_dim)
    assert (keys[0] - keys[1]).abs().max() > 1e-3  # same weights, other inputs and adapters
    assert tensor_name(0, "key") not in entry and tensor_name(2, "key") not in entry


def test_the_mamba2_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    """transformers' own decays (A = 1..H; dt in [0.001, 0.1]) and larger weights, so that `addition` (P = 1)
    visibly differs."""
    hf_model = build_tiny_model("zamba2", seed=9, num_hidden_layers=1, mamba_d_conv=conv_kernel, slow_decay=False,
                                initializer_range=0.3)
    assert hf_model.config.layers_block_type == ["linear_attention"]
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    check_linear_only_transition_is_exact(_linear_only_engine(conv_kernel=1), chunks)


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    check_conv_tail_needs_the_seam(_linear_only_engine(conv_kernel=4), seam=3)


@pytest.mark.parametrize("rope", [False, True])
def test_deviation_from_full_is_ordered_over_random_requests(rope: bool) -> None:
    """Slow decays (A log-uniform in [0.005, 0.5]) and peaked attention (initializer_range 0.2): mean KL over 20
    requests, hypic < transition_rope < addition (RoPE), hypic < transition < addition (NoPE)."""
    hf_model = build_tiny_model("zamba2", seed=0, num_hidden_layers=6, use_mem_rope=rope)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=rope)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_published_ssm_checkpoint(tmp_path_factory.mktemp("zamba2"), corpus_tokenizer(), kind="zamba2")


def test_the_stand_in_has_zamba2s_published_layout(published) -> None:
    directory, _ = published
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Zamba2ForCausalLM"] and config["num_mem_blocks"] == 2
    assert config["layers_block_type"][:2] == ["mamba", "hybrid"] and "tie_word_embeddings" not in config
    names = set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])
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
