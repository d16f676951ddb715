"""LiquidAI LFM2 (`lfm2`: gated short convolutions without a recurrent state, RoPE attention with per-head q/k layer
norms) on the mixer interface, against transformers' forward and against `full` (the checks every family passes:
test_every_family.py).

A conv layer's whole context is its conv tail (the last kernel-1 inputs B * x), so what the issue's checks mean here:
composition has no map to apply (`transition` and `addition` are the same computation), a one-layer conv-only model
is exact from its cached tails alone, and the ordering that can hold is hypic < transition_rope < transition ==
addition (docs/families_linear.md, "lfm2")."""

from __future__ import annotations

import json

import pytest
import torch
from family_modes import mean_deviations, random_request
from ssm_checks import TEXTS, check_precompute_and_ask, check_published_checkpoint_loads

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.blocks import ResidualBlock
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.short_conv import ShortConvMixer
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model
from kits.published import LFM2_LAYER_FORMS, save_lfm2_checkpoint

MODEL_TYPE = "lfm2"


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    assert "conv" in hf_model.config.layer_types and "full_attention" in hf_model.config.layer_types
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block, ResidualBlock)
        if kind == "conv":
            assert isinstance(block.mixer, ShortConvMixer) and block.mixer.transition_kind is None
        else:
            assert isinstance(block.mixer, ProjectedAttention) and isinstance(block.mixer.positions, RotaryPositions)


def test_transition_rope_is_not_exact(tiny) -> None:
    """Beside `check_seams_and_prefix_are_exact` (test_every_family.py): not every mode is exact."""
    _, engine = tiny
    request = random_request(torch.Generator().manual_seed(1), [9, 13, 5, 11])
    full = engine.prefill(request, "full").logits
    assert (engine.prefill(request, "transition_rope").logits - full).abs().max() > 1e-3


def test_entries_hold_only_conv_tails_for_conv_layers(tiny) -> None:
    hf_model, engine = tiny
    entry = engine.encode_segment(list(range(20)), 4)
    conv_layers = [i for i, kind in enumerate(hf_model.config.layer_types) if kind == "conv"]
    for index in conv_layers:
        assert tuple(entry[tensor_name(index, "conv_tail")].shape) == (64, 2)
        assert tensor_name(index, "transition") not in entry and tensor_name(index, "suffix_state") not in entry


def _conv_only_engine(layers: int, kernel: int, seam: int) -> Engine:
    hf_model = build_tiny_model(MODEL_TYPE, seed=9, num_hidden_layers=layers, layer_types=["conv"] * layers,
                                conv_L_cache=kernel)
    return Engine(wrap_model(hf_model), seam_tokens=seam)


@pytest.mark.parametrize("kernel", [1, 3])
@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_one_conv_layer_composes_exactly_from_its_tails(chunks: int, kernel: int) -> None:
    """The issue's one-layer linear-only composition, in the sense that applies without a recurrent state: over 2-6
    random chunks, `transition` (cached tails, nothing else) equals `full` (1e-5) and ends with `full`'s conv tail,
    whatever the kernel; `addition` is the same computation (no map to apply, bit-identical); `hypic` with a seam of
    kernel-1 tokens equals `full` too."""
    engine = _conv_only_engine(1, kernel, seam=kernel - 1)
    generator = torch.Generator().manual_seed(chunks)
    request = random_request(generator, torch.randint(3, 30, (chunks,), generator=generator).tolist(), prefix=0)
    full = engine.prefill(request, "full")
    transition = engine.prefill(request, "transition")
    torch.testing.assert_close(transition.logits, full.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(transition.state.linear[0].conv_tail, full.state.linear[0].conv_tail)
    assert tuple(full.state.linear[0].conv_tail.shape) == (64, kernel - 1)
    assert torch.equal(engine.prefill(request, "addition").logits, transition.logits)
    torch.testing.assert_close(engine.prefill(request, "hypic").logits, full.logits, atol=1e-5, rtol=1e-5)


def test_conv_only_stacks_need_the_seam_only_within_their_receptive_field() -> None:
    """Two conv layers (kernel 3): a token sees 2 * 2 tokens back. Chunks of >= 4 tokens carry exact tails, so
    `transition` equals `full`; a 2-token chunk right before a 1-token question was convolved against zeros in its
    entry, so `transition` is off and a seam of 2 (recomputing it) repairs it."""
    engine = _conv_only_engine(2, 3, seam=2)
    generator = torch.Generator().manual_seed(6)
    long_chunks = random_request(generator, [7, 12, 9, 15], prefix=0)
    torch.testing.assert_close(engine.prefill(long_chunks, "transition").logits,
                               engine.prefill(long_chunks, "full").logits, atol=1e-5, rtol=1e-5)
    short_last = random_request(generator, [7, 2], prefix=0, question=1)
    full = engine.prefill(short_last, "full").logits
    assert (engine.prefill(short_last, "transition").logits - full).abs().max() > 1e-3
    torch.testing.assert_close(engine.prefill(short_last, "hypic").logits, full, atol=1e-5, rtol=1e-5)


def test_deviation_from_full_is_ordered_over_random_requests() -> None:
    """Mean KL(full || mode) over 20 random requests, 8 layers (attention at i % 4 == 3, peaked: q/k norm gains
    about 2.5), seam 8: hypic < transition_rope < addition, and addition == transition (no recurrent state, so no
    composition to get wrong: what separates the modes is the seam and the keys' positions)."""
    layer_types = (["conv"] * 3 + ["full_attention"]) * 2
    hf_model = build_tiny_model(MODEL_TYPE, seed=0, num_hidden_layers=8, layer_types=layer_types)
    totals = mean_deviations(Engine(wrap_model(hf_model), seam_tokens=8),
                             ("hypic", "transition_rope", "transition", "addition"))
    assert totals["hypic"] < totals["transition_rope"] < totals["addition"], totals
    assert totals["addition"] == totals["transition"], totals


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """LFM2-1.2B stand-ins per layer form: {form: (directory, instance)}."""
    return {form: save_lfm2_checkpoint(tmp_path_factory.mktemp(form), TEXTS * 4, layer_form=form, seed=number)
            for number, form in enumerate(LFM2_LAYER_FORMS)}


@pytest.mark.parametrize("layer_form", LFM2_LAYER_FORMS)
def test_the_stand_in_has_lfm2s_published_layout(stand_ins, layer_form: str) -> None:
    directory, _ = stand_ins[layer_form]
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Lfm2ForCausalLM"] and config["model_type"] == "lfm2"
    assert config["full_attn_idxs"] == [2, 5] and ("layer_types" in config) == (layer_form == "layer_types")
    assert config["tie_embedding"] is True and "tie_word_embeddings" not in config
    assert config["conv_L_cache"] == 3 and config["block_ff_dim"] == 200 and config["block_auto_adjust_ff_dim"]
    from safetensors import safe_open

    assert not (directory / "model.safetensors.index.json").exists()  # one file, as the 1.2B ships
    with safe_open(str(directory / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        assert tuple(weights.get_slice("model.layers.0.conv.conv.weight").get_shape()) == (64, 1, 3)
    assert {"model.embed_tokens.weight", "model.embedding_norm.weight", "model.layers.0.conv.in_proj.weight",
            "model.layers.0.conv.out_proj.weight", "model.layers.0.feed_forward.w1.weight",
            "model.layers.0.operator_norm.weight", "model.layers.2.self_attn.q_layernorm.weight",
            "model.layers.2.self_attn.out_proj.weight"} <= names
    assert "lm_head.weight" not in names  # tied to the embeddings


@pytest.mark.parametrize("layer_form", LFM2_LAYER_FORMS)
def test_a_published_checkpoint_loads_and_equals_its_instance(stand_ins, layer_form: str) -> None:
    """`load_model` reads the published keys (`full_attn_idxs` alone too, `tie_embedding`, `block_ff_dim`
    auto-adjusted to 160): `full` equals the instance the directory holds (1e-4), and so does `hypic` with seams
    covering every chunk."""
    directory, instance = stand_ins[layer_form]
    engine = check_published_checkpoint_loads(directory, instance)
    model = engine.model
    assert model.family.model_types == ("lfm2",)
    assert model.layer_types == tuple("full_attention" if i in (2, 5) else "linear_attention" for i in range(6))
    assert model.hf_model.model.layers[0].feed_forward.w1.out_features == 160
    ids = torch.randint(3, len(model.tokenizer), (50,), generator=torch.Generator().manual_seed(0)).tolist()
    request = Request(ids[:4], [ids[4:20], ids[20:37], ids[37:44]], ids[44:])
    with torch.no_grad():
        expected = instance(torch.tensor([request.all_ids()]), use_cache=False).logits[0, -1]
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=17).logits, expected, atol=1e-4, rtol=1e-4)


def test_precompute_and_ask_run_on_a_published_stand_in(stand_ins, tmp_path) -> None:
    """`precompute` and `ask` (the CLI's `main`) on the first-release layout (`full_attn_idxs` alone): every chunk
    precomputed, then answered."""
    directory, _ = stand_ins["full_attn_idxs"]
    check_precompute_and_ask(directory, tmp_path)
