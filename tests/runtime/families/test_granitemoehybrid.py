"""IBM Granite 4.0-H (`granitemoehybrid`: Mamba2 / SSD + NoPE attention, MoE + shared MLP, multipliers) through the
mixer interface, against transformers' own forward and against `full` in every mode that must be exact."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.entry.schema import tensor_name
from hypic_rag.testing.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions
from hypic_rag.runtime.mixers.ssd import Mamba2Mixer
from hypic_rag.runtime.model import load_model, wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.testing import build_tiny_model, random_request, save_tiny_checkpoint




@pytest.fixture(scope="module", params=["nope", "rope"])
def tiny(request):
    hf_model = build_tiny_model("granitemoehybrid", seed=3, position_embedding_type=request.param)
    return hf_model, Engine(wrap_model(hf_model), seam_tokens=4)


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


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    hf_model, engine = tiny
    request = random_request(torch.Generator().manual_seed(0), [23, 40, 17])
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = hf_model(ids, use_cache=False).logits[0, -1]
    result = engine.prefill(request, "full")
    torch.testing.assert_close(result.logits, expected, atol=1e-4, rtol=1e-4)
    generation = engine.generate(request, "full", SamplingParams(max_new_tokens=16))
    expected_tokens = hf_model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
    assert generation.token_ids == expected_tokens


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(1), [9, 13, 5, 11])
    full = engine.prefill(request, "full").logits
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=13).logits, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(request, "prefix").logits, full, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3  # the modes are not all exact


def test_repositioning_is_a_no_op_only_without_rope(tiny) -> None:
    hf_model, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    transition_rope = engine.prefill(request, "transition_rope").logits
    if hf_model.config.position_embedding_type == "rope":
        assert (transition - transition_rope).abs().max() > 1e-4
    else:
        torch.testing.assert_close(transition_rope, transition, atol=1e-6, rtol=1e-6)


def test_entries_hold_a_scalar_transition_per_head(tiny) -> None:
    hf_model, engine = tiny
    config = hf_model.config
    entry = engine.encode_segment(list(range(30)), 4)
    heads, state, head_dim = config.mamba_n_heads, config.mamba_d_state, config.mamba_d_head
    conv_dim = config.mamba_expand * config.hidden_size + 2 * config.mamba_n_groups * state
    assert tuple(entry[tensor_name(0, "transition")].shape) == (heads, 1, 1)
    assert tuple(entry[tensor_name(0, "suffix_state")].shape) == (heads, state, head_dim)
    assert tuple(entry[tensor_name(0, "conv_tail")].shape) == (conv_dim, config.mamba_d_conv - 1)
    attention = config.layer_types.index("full_attention")
    assert tuple(entry[tensor_name(attention, "key")].shape) == (config.num_key_value_heads, 30, 16)


def test_the_mamba2_mixer_meets_the_contract(tiny) -> None:
    _, engine = tiny
    x = torch.randn(41, 64, generator=torch.Generator().manual_seed(5))
    check_recurrent_mixer(engine.model.blocks[0].mixer, x, split=17)


def _linear_only_engine(conv_kernel: int) -> Engine:
    hf_model = build_tiny_model(
        "granitemoehybrid", seed=9, num_hidden_layers=1, layer_types=["linear_attention"], mamba_d_conv=conv_kernel
    )
    return Engine(wrap_model(hf_model), seam_tokens=3)


@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(chunks: int) -> None:
    engine = _linear_only_engine(conv_kernel=1)
    generator = torch.Generator().manual_seed(chunks)
    request = random_request(generator, torch.randint(3, 30, (chunks,), generator=generator).tolist(), prefix=0)
    full = engine.prefill(request, "full")
    transition = engine.prefill(request, "transition")
    torch.testing.assert_close(transition.logits, full.logits, atol=1e-5, rtol=1e-5)
    for layer_index, state in full.state.linear.items():
        torch.testing.assert_close(transition.state.linear[layer_index].recurrent, state.recurrent, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "addition").logits - full.logits).abs().max() > 1e-3


def test_linear_only_conv_kernel_four_needs_the_seam() -> None:
    engine = _linear_only_engine(conv_kernel=4)
    request = random_request(torch.Generator().manual_seed(12), [15, 22, 9, 30], prefix=0)
    full = engine.prefill(request, "full").logits
    assert (engine.prefill(request, "transition").logits - full).abs().max() > 1e-3
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=3).logits, full, atol=1e-5, rtol=1e-5)


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
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache

    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(7), [19, 26, 11])
    expected = engine.prefill(request, "hypic").logits
    namespace = CacheNamespace.for_model(engine.model, 4, cache_format=cache_format)
    for attempt in ("encode", "hit"):
        cache = SegmentCache.open(tmp_path / "cache", namespace=namespace)
        try:
            result = Engine(engine.model, seam_tokens=4, segment_source=cache).prefill(request, "hypic")
        finally:
            cache.close()
        assert (result.stats.cache_misses == 0) == (attempt == "hit")
        tolerance = 1e-5 if cache_format == "float32" else 2e-2  # 8-bit groups: ~2-3 digits
        torch.testing.assert_close(result.logits, expected, atol=tolerance, rtol=tolerance)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Mean KL(full || mode) over 20 random requests on 8 layers (NoPE, slow decays): hypic < transition <
    addition, and re-positioning is a no-op (transition_rope == transition)."""
    from hypic_rag.runtime.quality import kl_divergence

    layer_types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    hf_model = build_tiny_model("granitemoehybrid", seed=0, num_hidden_layers=8, layer_types=layer_types)
    engine = Engine(wrap_model(hf_model), seam_tokens=8)
    generator = torch.Generator().manual_seed(0)
    totals = {"hypic": 0.0, "transition": 0.0, "transition_rope": 0.0, "addition": 0.0}
    for _ in range(20):
        count = int(torch.randint(2, 6, (1,), generator=generator))
        request = random_request(generator, torch.randint(16, 48, (count,), generator=generator).tolist(), prefix=6, question=8)
        reference = engine.prefill(request, "full").logits
        for mode in totals:
            totals[mode] += kl_divergence(reference, engine.prefill(request, mode).logits) / 20
    assert totals["hypic"] < totals["transition"] < totals["addition"], totals
    assert totals["transition_rope"] == pytest.approx(totals["transition"], rel=1e-6)
