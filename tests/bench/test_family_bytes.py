"""Bytes per chunk at published shapes come from the runtime's own entry: the layout a meta-device model yields is
the entry a real model of the same config encodes (names, shapes, dtypes), for every family; the published rows
hold what the shapes say (checked by hand arithmetic for a scalar, a vector and a conv-only family)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.bench.family_bytes import entry_sizes, layout_entry, meta_model, published_row
from hypic_rag.bench.published_layouts import PUBLISHED_LAYOUTS, PublishedLayout
from hypic_rag.entry.schema import SEAM_TOKENS, TOKEN_IDS
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import SUPPORTED_TINY_TYPES, build_tiny_model

MIB = 2**20


def described(entry: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in entry.items() if name not in (TOKEN_IDS, SEAM_TOKENS)}


@pytest.mark.parametrize("model_type", SUPPORTED_TINY_TYPES)
def test_the_meta_layout_is_the_encoded_entry(model_type: str) -> None:
    hf_model = build_tiny_model(model_type, seed=0)
    ids = torch.randint(0, 200, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    encoded = Engine(wrap_model(hf_model), seam_tokens=5).encode_segment(ids)
    layout = layout_entry(meta_model(hf_model.config, dtype=torch.float32), 37, 5)
    assert all(t.is_meta for name, t in layout.items() if name not in (TOKEN_IDS, SEAM_TOKENS))
    assert described(layout) == described(encoded)
    assert entry_sizes(layout) == entry_sizes(encoded)
    assert entry_sizes(layout)["total"] > 0


def test_a_meta_model_holds_no_weights_and_is_fingerprinted_by_its_config() -> None:
    config = PUBLISHED_LAYOUTS["lfm2"].config()
    model = meta_model(config)
    assert all(parameter.is_meta for parameter in model.hf_model.parameters())
    assert model.fingerprint == meta_model(PUBLISHED_LAYOUTS["lfm2"].config()).fingerprint
    config.num_key_value_heads = 4
    assert meta_model(config).fingerprint != model.fingerprint


def test_jamba_v0_1_row_is_its_shapes() -> None:
    """Mamba1 (elementwise P [D, N]) in 28 layers, NoPE attention in 4: P, Z, tails float32, K/V bfloat16."""
    row = published_row(PUBLISHED_LAYOUTS["jamba"])
    inner, state, kernel = 2 * 4096, 16, 4
    assert row["layer_kinds"] == {"linear_attention": 28, "full_attention": 4}
    assert row["recurrent_mixers"] == {"Mamba1Mixer (vector)": 28} and row["attention_positions"] == ["NoPE"]
    sizes = row["bytes"]
    assert sizes["transition"] == sizes["suffix_state"] == 28 * inner * state * 4
    assert sizes["conv_tail"] == 28 * inner * (kernel - 1) * 4
    assert sizes["key_value"] == 4 * 2 * 8 * 256 * 128 * 2
    assert sizes["total"] == sizes["linear_state"] + sizes["key_value"]
    assert sizes["pz_bfloat16_total"] == sizes["total"] - 28 * inner * state * 2 * 2


def test_scalar_and_conv_only_rows() -> None:
    """Granite 4.0-H-Tiny: P a scalar per head ([48, 1, 1]); LFM2-1.2B: conv tails only, no P or Z."""
    granite = published_row(PUBLISHED_LAYOUTS["granitemoehybrid"])["bytes"]
    assert granite["transition"] == 36 * 48 * 4
    assert granite["suffix_state"] == 36 * 48 * 64 * 128 * 4
    assert granite["conv_tail"] == 36 * (3072 + 2 * 128) * 3 * 4
    lfm2 = published_row(PUBLISHED_LAYOUTS["lfm2"])
    assert lfm2["recurrent_mixers"] == {"ShortConvMixer (no state)": 10}
    assert lfm2["bytes"]["transition"] == lfm2["bytes"]["suffix_state"] == 0
    assert lfm2["bytes"]["conv_tail"] == 10 * 2048 * 2 * 4
    assert lfm2["bytes"]["key_value"] == 6 * 2 * 8 * 256 * 64 * 2 == 3 * MIB


def test_a_layout_needs_a_name_and_a_source() -> None:
    with pytest.raises(ValueError):
        PublishedLayout("jamba", "", "somewhere")
