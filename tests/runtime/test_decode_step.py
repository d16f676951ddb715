"""A CPU decode step's short forms: `gated_delta_rule_step` (one token, key heads unrepeated) against the naive
recurrence, and `GatedDeltaNetMixer.step` (`FUSED_STEP`) against the generic step over runs of one token (the
reference), on random inputs: same outputs, conv tails and states to float32 round-off, the start states unread-only."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.mixers import gated_deltanet
from hypic_rag.runtime.mixers.base import Projections, RecurrentMixer
from hypic_rag.runtime.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule.recurrent import gated_delta_rule_step


@pytest.mark.parametrize(("key_heads", "value_heads", "batch"), [(2, 4, 1), (3, 3, 2), (2, 6, 3)])
def test_one_step_matches_the_naive_recurrence(key_heads: int, value_heads: int, batch: int) -> None:
    generator = torch.Generator().manual_seed(key_heads * 10 + value_heads + batch)
    key_dim, value_dim = 8, 5
    query = torch.randn(batch, key_heads, key_dim, generator=generator)
    key = torch.nn.functional.normalize(torch.randn(batch, key_heads, key_dim, generator=generator), dim=-1)
    value = torch.randn(batch, value_heads, value_dim, generator=generator)
    log_decay = -torch.rand(batch, value_heads, generator=generator)
    beta = torch.rand(batch, value_heads, generator=generator)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=generator)
    kept = state.clone()
    output, final = gated_delta_rule_step(query, key, value, log_decay, beta, state)
    groups = value_heads // key_heads
    expected_output, expected_final = naive_recurrent_gated_delta_rule(
        query.repeat_interleave(groups, dim=1)[:, :, None], key.repeat_interleave(groups, dim=1)[:, :, None],
        value[:, :, None], log_decay[:, :, None], beta[:, :, None], state)
    torch.testing.assert_close(output, expected_output[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, kept)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
@pytest.mark.parametrize("batch", [1, 3])
def test_the_mixers_fused_step_matches_the_generic_step(model_type: str, batch: int, monkeypatch) -> None:
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.testing import build_tiny_model

    model = wrap_model(build_tiny_model(model_type, seed=7))
    mixer = next(block.mixer for block in model.blocks if isinstance(block.mixer, gated_deltanet.GatedDeltaNetMixer))
    generator = torch.Generator().manual_seed(batch)
    with torch.no_grad():
        projections = mixer.project(torch.randn(batch, model.config.hidden_size, generator=generator))
        tails = torch.randn(batch, mixer.conv_channels, mixer.conv_width, generator=generator)
        starts = torch.randn(batch, *mixer.state_shape, generator=generator)
        kept = (tails.clone(), starts.clone())
        fused = mixer.step(projections, tails, starts)
        reference = RecurrentMixer.step(mixer, projections, tails, starts)
        monkeypatch.setattr(gated_deltanet, "FUSED_STEP", False)
        switched_off = mixer.step(projections, tails, starts)
    for got, want, also in zip(fused, reference, switched_off):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(also, want)
    assert torch.equal(tails, kept[0]) and torch.equal(starts, kept[1])
    assert isinstance(projections, Projections)
