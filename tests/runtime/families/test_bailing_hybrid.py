"""bailing_hybrid (Ling 3) on the mixer interface: KDA with the bounded gate, MLA with interleaved RoPE on its shared
key part and a per-head output gate, against transformers' forward and `full` (the checks every family passes:
test_every_family.py)."""

from __future__ import annotations

import torch
from family_modes import random_request

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.mixers.kda import KdaMixer
from hypic_rag.runtime.mixers.latent_attention import InterleavedTailRotary, LatentAttention
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model

MODEL_TYPE = "bailing_hybrid"


def test_blocks_follow_the_layer_types(tiny) -> None:
    hf_model, engine = tiny
    for block, kind in zip(engine.model.blocks, hf_model.config.layer_types):
        assert isinstance(block.mixer, KdaMixer if kind == "linear_attention" else LatentAttention)
        if kind == "full_attention":
            assert isinstance(block.mixer.positions, InterleavedTailRotary)
            assert block.mixer.positions.rotary_dim == hf_model.config.qk_rope_head_dim


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
