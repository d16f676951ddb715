"""IBM Granite 4.0-H (`granitemoehybrid`: Mamba2 / SSD + NoPE attention, MoE + shared MLP, multipliers) through the
mixer interface: what is particular to it (the checks every family passes: test_every_family.py)."""

from __future__ import annotations

import pytest
import torch

from family_modes import mean_deviations, tiny_engine
from ssm_checks import check_mamba2_entry_shapes, served_from_a_segment_cache

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import load_model, wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model, save_tiny_checkpoint


@pytest.fixture(scope="module", params=["nope", "rope"])
def tiny(request):
    return tiny_engine("granitemoehybrid", position_embedding_type=request.param)


def test_blocks_mixers_and_positions(tiny) -> None:
    hf_model, engine = tiny
    kinds = hf_model.config.layer_types
    assert engine.model.layer_types == tuple(kinds) and "full_attention" in kinds
    for block, kind in zip(engine.model.blocks, kinds):
        assert isinstance(block.mixer, Mamba2Mixer) == (kind == "linear_attention")
        assert block.residual_multiplier == pytest.approx(0.22)
    attention = engine.model.blocks[kinds.index("full_attention")].mixer
    rope = hf_model.config.position_embedding_type == "rope"
    assert isinstance(attention.positions, RotaryPositions if rope else NoPositions)


def test_entries_hold_a_scalar_transition_per_head(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size
    check_mamba2_entry_shapes(engine, 0, heads=config.mamba_n_heads, state=config.mamba_d_state,
                              head_dim=config.mamba_d_head, groups=config.mamba_n_groups,
                              conv_kernel=config.mamba_d_conv)
    entry = engine.encode_segment(list(range(30)), 4)
    attention = config.layer_types.index("full_attention")
    assert tuple(entry[tensor_name(attention, "key")].shape) == (config.num_key_value_heads, 30, 16)


def test_a_checkpoint_directory_loads_and_decodes(tmp_path) -> None:
    path = save_tiny_checkpoint(tmp_path / "granite", ["a small corpus", "of a few words"] * 20,
                                model_type="granitemoehybrid", seed=4)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:  # the names Granite 4.0-H publishes
        names = set(weights.keys())
    assert {"model.layers.0.mamba.in_proj.weight", "model.layers.0.block_sparse_moe.input_linear.weight",
            "model.layers.0.block_sparse_moe.router.layer.weight", "model.layers.0.shared_mlp.output_linear.weight",
            "model.layers.2.self_attn.q_proj.weight"} <= names
    model = load_model(path, device="cpu")
    assert model.family.model_types == ("granitemoehybrid",) and model.tokenizer is not None
    engine = Engine(model, seam_tokens=4)
    request = Request(model.tokenizer.encode("a small"), [model.tokenizer.encode("corpus of a few words")] * 2,
                      model.tokenizer.encode("words"))
    generation = engine.generate(request, "hypic", SamplingParams(max_new_tokens=4))
    assert len(generation.token_ids) == 4 or generation.finish_reason == "stop"
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = model.hf_model(ids, use_cache=False).logits[0, -1]
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_format", ["float32", "int8"])
def test_entries_round_trip_through_the_segment_cache(tiny, tmp_path, cache_format: str) -> None:
    """Scalar transitions and SSD states stored in the LMDB cache (and, compressed to int8 groups) serve the same request."""
    expected, served = served_from_a_segment_cache(tiny[1], tmp_path / "cache", cache_format)
    tolerance = 1e-5 if cache_format == "float32" else 2e-2  # 8-bit groups: ~2-3 digits
    for logits in served.values():
        torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Mean KL(full || mode) over 20 random requests on 8 layers (NoPE, slow decays): hypic < transition <
    addition, and re-positioning is a no-op (transition_rope == transition)."""
    layer_types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    hf_model = build_tiny_model("granitemoehybrid", seed=0, num_hidden_layers=8, layer_types=layer_types)
    totals = mean_deviations(Engine(wrap_model(hf_model), seam_tokens=8),
                             ("hypic", "transition", "transition_rope", "addition"))
    assert totals["hypic"] < totals["transition"] < totals["addition"], totals
    assert totals["transition_rope"] == pytest.approx(totals["transition"], rel=1e-6)
