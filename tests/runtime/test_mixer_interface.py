"""The one mixer interface: the family registry, the three transition kinds of `SegmentState`, the recurrent-mixer
contract on Gated DeltaNet, and attention without positions (NoPE), where re-positioning is a no-op."""

from __future__ import annotations

import functools

import pytest
import torch

from kits.mixer_checks import check_recurrent_mixer
from hypic_rag.runtime.blocks import ResidualBlock
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families import family_for, register_family, supported_model_types
from hypic_rag.runtime.families.qwen import QwenHybrid
from hypic_rag.runtime.mixers.attention import ProjectedAttention, RotaryPositions
from hypic_rag.runtime.mixers.base import NoPositions, Positioner
from hypic_rag.runtime.mixers.gated_deltanet import GatedDeltaNetMixer
from hypic_rag.runtime.model import UnsupportedModelError, load_model, wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.segment_state import SegmentState, apply_in_order
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request




# ------------------------------------------------------------------------------------------------ the registry
def test_the_registry_serves_the_qwen_families_and_refuses_others() -> None:
    for model_type in ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"):
        assert isinstance(family_for(model_type), QwenHybrid), model_type
        assert model_type in supported_model_types()
    assert family_for("granitemoehybrid").model_types == ("granitemoehybrid",)
    assert family_for("llama") is None and family_for(None) is None
    with pytest.raises(ValueError, match="already served by QwenHybrid"):
        register_family(type("Impostor", (QwenHybrid,), {})())
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match="model type 'llama' is not supported; supported: qwen3_5, .*granitemoehybrid"):
        load_model(config, device="cpu")


def test_blocks_follow_the_layer_types() -> None:
    model = wrap_model(build_tiny_model("qwen3_next", seed=0))
    assert len(model.blocks) == len(model.config.layer_types)
    for block, kind in zip(model.blocks, model.config.layer_types):
        assert isinstance(block, ResidualBlock) and block.layer_type == kind
        mixer_class = GatedDeltaNetMixer if kind == "linear_attention" else ProjectedAttention
        assert isinstance(block.mixer, mixer_class)
    assert model.layer_types == tuple(model.config.layer_types)


# ------------------------------------------------------------------------------------------ transition kinds
def random_maps(kind: str, count: int, seed: int, heads: int = 3, key_dim: int = 6, value_dim: int = 5) -> list[SegmentState]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"matrix": (heads, key_dim, key_dim), "vector": (heads, key_dim, 1), "scalar": (heads, 1, 1),
              "elementwise": (heads, key_dim, value_dim)}
    stored_kind = "vector" if kind == "elementwise" else kind
    maps = []
    for _ in range(count):
        transition = torch.randn(*shapes[kind], generator=generator) * (0.5 if kind == "matrix" else 1.0)
        maps.append(SegmentState(transition, torch.randn(heads, key_dim, value_dim, generator=generator), stored_kind))
    return maps


def as_matrix(segment: SegmentState) -> SegmentState | None:
    """The same map with P written as a K x K matrix (scalar: p I; per-key vector: diag(p)); None for elementwise."""
    key_dim = segment.state.shape[-2]
    if segment.kind == "scalar":
        return SegmentState(segment.transition * torch.eye(key_dim), segment.state)
    if segment.kind == "vector" and segment.transition.shape[-1] == 1:
        return SegmentState(torch.diag_embed(segment.transition[..., 0]), segment.state)
    return None


@pytest.mark.parametrize("kind", ["matrix", "vector", "scalar", "elementwise"])
@pytest.mark.parametrize("count", [1, 2, 5])
def test_every_kind_composes_like_sequential_application(kind: str, count: int) -> None:
    maps = random_maps(kind, count, seed=count)
    start = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(99))
    sequential = start
    for segment in maps:
        sequential = segment.apply(sequential)
    composed = functools.reduce(SegmentState.then, maps)
    torch.testing.assert_close(composed.apply(start), sequential, atol=1e-5, rtol=1e-5)
    assert composed.kind == maps[0].kind and composed.transition.shape == maps[0].transition.shape
    torch.testing.assert_close(
        apply_in_order(start, [m.transition for m in maps], [m.state for m in maps], maps[0].kind), sequential,
        atol=1e-5, rtol=1e-5,
    )
    if count >= 3:  # associativity
        right = maps[0].then(functools.reduce(SegmentState.then, maps[1:]))
        torch.testing.assert_close(right.apply(start), sequential, atol=1e-5, rtol=1e-5)
    matrices = [as_matrix(segment) for segment in maps]
    if all(matrix is not None for matrix in matrices) and kind != "matrix":  # the small P is the big one, exactly
        torch.testing.assert_close(functools.reduce(SegmentState.then, matrices).apply(start), sequential, atol=1e-5, rtol=1e-5)
    identity = SegmentState.identity(start, maps[0].kind, maps[0].transition.shape)
    torch.testing.assert_close(identity.then(maps[0]).apply(start), maps[0].apply(start))
    torch.testing.assert_close(maps[0].then(identity).apply(start), maps[0].apply(start))
    addition = apply_in_order(start, None, [m.state for m in maps], maps[0].kind)
    torch.testing.assert_close(addition, start + sum(m.state for m in maps))


def test_kind_shapes_are_checked() -> None:
    state = torch.zeros(3, 6, 5)
    with pytest.raises(ValueError, match="a scalar transition must have shape"):
        SegmentState(torch.zeros(3, 6, 1), state, "scalar")
    with pytest.raises(ValueError, match="a vector transition must have the state's 3 dims"):
        SegmentState(torch.zeros(3, 6), state, "vector")
    with pytest.raises(ValueError, match="unknown transition kind 'diagonal'"):
        SegmentState(torch.zeros(3, 6, 5), state, "diagonal")
    with pytest.raises(ValueError, match="cannot compose a scalar transition with a vector one"):
        SegmentState(torch.ones(3, 1, 1), state, "scalar").then(SegmentState(torch.ones(3, 6, 1), state, "vector"))


# ------------------------------------------------------------------------------------- the mixer contract
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_gated_deltanet_meets_the_mixer_contract(model_type: str) -> None:
    model = wrap_model(build_tiny_model(model_type, seed=1))
    mixer = model.blocks[0].mixer
    assert isinstance(mixer, GatedDeltaNetMixer) and mixer.transition_kind == "matrix"
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    check_recurrent_mixer(mixer, x, split=13)


# -------------------------------------------------------------------------------------------- NoPE attention
class QwenWithoutPositions(QwenHybrid):
    """The Qwen family with its attention's rotary turned off: keys carry no positions (NoPE)."""

    model_types = ()

    def positions(self, hf_model) -> Positioner:
        return NoPositions()


@pytest.fixture(scope="module")
def nope_engine() -> Engine:
    hf_model = build_tiny_model("qwen3_5", seed=5, num_hidden_layers=4, initializer_range=0.1)
    return Engine(wrap_model(hf_model, family=QwenWithoutPositions()), seam_tokens=4)


def test_without_positions_transition_rope_is_transition(nope_engine: Engine) -> None:
    assert all(not block.attention.positions.moves_keys for block in nope_engine.model.blocks if block.attention)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        request = random_request(generator, torch.randint(5, 30, (3,), generator=generator).tolist())
        transition = nope_engine.prefill(request, "transition").logits
        torch.testing.assert_close(nope_engine.prefill(request, "transition_rope").logits, transition, atol=1e-6, rtol=1e-6)
        # ... while the same weights with RoPE re-positioned differ: positions did matter there
    rope_engine = Engine(wrap_model(nope_engine.model.hf_model), seam_tokens=4)
    rope = [rope_engine.prefill(request, mode).logits for mode in ("transition", "transition_rope")]
    assert (rope[0] - rope[1]).abs().max() > 1e-4


def test_without_positions_seams_and_prefix_stay_exact(nope_engine: Engine) -> None:
    request = random_request(torch.Generator().manual_seed(4), [9, 13, 5])
    full = nope_engine.prefill(request, "full").logits
    torch.testing.assert_close(nope_engine.prefill(request, "hypic", seam_tokens=13).logits, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(nope_engine.prefill(request, "prefix").logits, full, atol=1e-5, rtol=1e-5)


def test_a_single_nope_attention_layer_reuses_kv_exactly() -> None:
    """One attention layer: cached K/V of standalone chunks are the in-context ones when keys carry no position,
    so `transition` (no re-positioning) is exact; with RoPE it is not."""
    hf_model = build_tiny_model("qwen3_5", seed=4, num_hidden_layers=1, layer_types=["full_attention"])
    request = random_request(torch.Generator().manual_seed(3), [12, 18, 9], prefix=4)
    nope = Engine(wrap_model(hf_model, family=QwenWithoutPositions()), seam_tokens=0)
    full = nope.prefill(request, "full").logits
    torch.testing.assert_close(nope.prefill(request, "transition").logits, full, atol=1e-5, rtol=1e-5)
    assert isinstance(wrap_model(hf_model).blocks[0].mixer.positions, RotaryPositions)


# ------------------------------------------------------------------------------- a parallel block (Falcon-H1 shape)
class QwenInParallel(QwenHybrid):
    """Every layer runs a Gated DeltaNet and an attention side by side (Falcon-H1's shape), borrowing the mixers of
    a 4-layer Qwen3.5 model: layer i gets GDN of its linear layer i % 3 and the attention of layer 3, with input and
    output multipliers; then its own MLP."""

    model_types = ()

    def build_blocks(self, hf_model):
        from hypic_rag.runtime.blocks import Branch, ParallelBlock

        layers = self.backbone(hf_model).layers
        attention = ProjectedAttention(layers[3].self_attn, self.positions(hf_model))
        return tuple(
            ParallelBlock(
                (Branch(GatedDeltaNetMixer(layers[i % 3].linear_attn), 1.0, 0.7), Branch(attention, 0.5, 1.3)),
                layer.input_layernorm, layer.mlp, layer.post_attention_layernorm,
            )
            for i, layer in enumerate(layers)
        )


@torch.no_grad()
def parallel_reference(hf_model, token_ids: list[int]) -> torch.Tensor:
    """`QwenInParallel`'s last-token logits through transformers' own module forwards (no runtime code)."""
    backbone = hf_model.model
    ids = torch.tensor([token_ids])
    hidden = backbone.embed_tokens(ids)
    position_embeddings = backbone.rotary_emb(hidden, torch.arange(ids.shape[1])[None])
    for i, layer in enumerate(backbone.layers):
        x = layer.input_layernorm(hidden)
        linear = backbone.layers[i % 3].linear_attn(x)
        attention, _ = backbone.layers[3].self_attn(0.5 * x, position_embeddings=position_embeddings, attention_mask=None)
        hidden = hidden + 0.7 * linear + 1.3 * attention
        out = layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = hidden + (out[0] if isinstance(out, tuple) else out)
    return hf_model.lm_head(backbone.norm(hidden))[0, -1]


def test_a_parallel_block_keeps_both_states_per_layer_and_stays_exact() -> None:
    hf_model = build_tiny_model("qwen3_5", seed=6, num_hidden_layers=4)
    model = wrap_model(hf_model, family=QwenInParallel())
    assert model.layer_types == ("linear_attention+full_attention",) * 4
    engine = Engine(model, seam_tokens=4)
    request = random_request(torch.Generator().manual_seed(8), [9, 13, 5, 11])
    full = engine.prefill(request, "full")
    assert set(full.state.linear) == set(full.state.attention) == {0, 1, 2, 3}
    entry = engine.encode_segment(request.chunk_ids[0], 4)
    assert {f"layers.1.{part}" for part in ("transition", "suffix_state", "conv_tail", "key", "value")} <= set(entry)
    torch.testing.assert_close(full.logits, parallel_reference(hf_model, request.all_ids()), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(request, "hypic", seam_tokens=13).logits, full.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.prefill(request, "prefix").logits, full.logits, atol=1e-5, rtol=1e-5)
    assert (engine.prefill(request, "transition_rope").logits - full.logits).abs().max() > 1e-3
    # decode from the assembled state equals prefilling one token more
    token = int(full.logits.argmax())
    stepped, _ = engine.decode_step(full.state, token)
    longer = Request(request.prefix_ids, request.chunk_ids, request.question_ids + [token])
    torch.testing.assert_close(stepped, engine.prefill(longer, "full").logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_the_runs_scan_and_the_identity_start_batch_agree_in_the_stack(model_type: str, monkeypatch) -> None:
    """The stack's two paths for a request's seam runs (runs packed in one scan with the cached maps applied between runs, and the
    identity-start batch composed afterwards) give the same logits in every mode that recomputes seams."""
    engine = Engine(wrap_model(build_tiny_model(model_type, seed=4)), seam_tokens=3)
    generator = torch.Generator().manual_seed(5)
    for chunk_lengths, policy in (([7, 2, 11], None), ([9, 9, 9, 4], "whole:1"), ([5], None)):
        request = random_request(generator, chunk_lengths, question=4)
        scanned = {mode: engine.prefill(request, mode, policy=policy).logits for mode in ("hypic", "transition_rope")}
        with monkeypatch.context() as patch:
            patch.setattr(GatedDeltaNetMixer, "scans_runs", property(lambda self: False))
            batched = {mode: engine.prefill(request, mode, policy=policy).logits for mode in scanned}
        for mode in scanned:
            torch.testing.assert_close(scanned[mode], batched[mode], atol=1e-5, rtol=1e-5)
