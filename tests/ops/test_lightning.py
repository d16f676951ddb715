"""Scalar-decay linear attention (MiniMax lightning): chunked and step paths against the naive float32 recurrence,
carried states, the scalar transition, and transformers' MiniMaxLightningAttention (prefill and cached paths)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypic_rag.runtime.ops.lightning import (
    ScalarDecaySpan,
    chunk_lightning,
    fused_recurrent_lightning,
    lightning_attention,
    lightning_with_transition,
    minimax_log_decay,
    naive_recurrent_lightning,
)

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def random_inputs(batch: int, heads: int, length: int, key_dim: int, value_dim: int, seed: int, per_token: bool):
    generator = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(batch, heads, length, key_dim, generator=generator) * 0.3 for _ in range(2))
    value = torch.randn(batch, heads, length, value_dim, generator=generator)
    if per_token:
        log_decay = -torch.rand(batch, heads, length, generator=generator)
    else:
        log_decay = minimax_log_decay(heads, layer_index=0, num_layers=4)  # [H, 1], the fastest MiniMax decays
    start = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return query, key, value, log_decay, start


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 131])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_naive_on_odd_lengths(length: int, chunk_size: int, per_token: bool) -> None:
    query, key, value, log_decay, start = random_inputs(2, 3, length, 16, 8, seed=length, per_token=per_token)
    expected_output, expected_state = naive_recurrent_lightning(query, key, value, log_decay, start)
    output, state = chunk_lightning(query, key, value, log_decay, start, chunk_size=chunk_size)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


def test_chunk_is_stable_with_strong_decay() -> None:
    query, key, value, _, start = random_inputs(1, 2, 100, 8, 8, seed=3, per_token=False)
    log_decay = torch.tensor([[-40.0], [-1e-4]])  # one head forgets at once, one keeps everything
    expected_output, expected_state = naive_recurrent_lightning(query, key, value, log_decay, start)
    output, state = chunk_lightning(query, key, value, log_decay, start, chunk_size=64)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


@pytest.mark.parametrize("cuts", [(1,), (17, 40), (5, 20, 50)])
def test_split_sequence_carries_state(cuts: tuple[int, ...]) -> None:
    query, key, value, log_decay, start = random_inputs(1, 2, 57, 8, 8, seed=11, per_token=True)
    whole_output, whole_state = chunk_lightning(query, key, value, log_decay, start, chunk_size=16)
    bounds = [0, *cuts, 57]
    state, pieces = start, []
    for begin, end in itertools.pairwise(bounds):
        piece = (x[:, :, begin:end] for x in (query, key, value, log_decay))
        output, state = lightning_attention(*piece, state, chunk_size=16)
        pieces.append(output)
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole_output, **TOLERANCE)
    torch.testing.assert_close(state, whole_state, **TOLERANCE)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("length", [0, 1, 29, 70])
def test_scalar_transition_reproduces_any_start(length: int, per_token: bool) -> None:
    query, key, value, log_decay, start = random_inputs(2, 2, length, 12, 6, seed=5, per_token=per_token)
    zero_output, start_weight, span = lightning_with_transition(query, key, value, log_decay, chunk_size=16)
    expected_output, expected_state = naive_recurrent_lightning(query, key, value, log_decay, start)
    assert span.decay.shape == (2, 2) and span.state.shape == (2, 2, 12, 6)
    torch.testing.assert_close(span.apply(start), expected_state, **TOLERANCE)
    torch.testing.assert_close(zero_output + start_weight[..., None] * (query @ start), expected_output, **TOLERANCE)
    torch.testing.assert_close(span.state, naive_recurrent_lightning(query, key, value, log_decay)[1], **TOLERANCE)
    if not per_token:  # MiniMax: the transition is exp(-slope_h * T)
        torch.testing.assert_close(span.decay, (log_decay[:, 0] * length).exp().expand(2, 2), **TOLERANCE)


def test_composed_spans_equal_the_whole() -> None:
    query, key, value, log_decay, start = random_inputs(1, 2, 48, 8, 4, seed=12, per_token=True)
    spans = [lightning_with_transition(*(x[:, :, a:b] for x in (query, key, value, log_decay)))[2]
             for a, b in ((0, 10), (10, 31), (31, 48))]
    composed = spans[0].then(spans[1]).then(spans[2])
    torch.testing.assert_close(composed.apply(start), naive_recurrent_lightning(query, key, value, log_decay, start)[1],
                               **TOLERANCE)
    with pytest.raises(ValueError, match="decay must have shape"):
        ScalarDecaySpan(torch.zeros(2), torch.zeros(1, 2, 4, 4))


@pytest.mark.parametrize("length", [0, 1, 3, 9])
def test_recurrent_matches_naive_and_keeps_its_input_state(length: int) -> None:
    query, key, value, log_decay, start = random_inputs(2, 3, length, 16, 8, seed=20 + length, per_token=True)
    start_copy = start.clone()
    expected_output, expected_state = naive_recurrent_lightning(query, key, value, log_decay, start)
    output, state = fused_recurrent_lightning(query, key, value, log_decay, start)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)
    assert torch.equal(start, start_copy)


def tiny_lightning_layer(layer_index: int = 1):
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    torch.manual_seed(layer_index)
    config = MiniMaxConfig(hidden_size=48, num_attention_heads=3, head_dim=16, num_hidden_layers=4, block_size=16,
                           pad_token_id=0)
    layer = MiniMaxLightningAttention(config, layer_index).eval()
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return config, layer


def our_lightning_layer(layer, hidden: torch.Tensor, start: torch.Tensor | None):
    """MiniMax's lightning mixer rebuilt on our op (the computation docs/families_linear.md describes)."""
    batch, length, _ = hidden.shape
    heads, head_dim = layer.num_attention_heads, layer.head_dim
    qkv = torch.nn.functional.silu(layer.qkv_proj(hidden)).view(batch, length, heads, 3 * head_dim)
    query, key, value = (x.transpose(1, 2) for x in qkv.split(head_dim, dim=-1))
    log_decay = minimax_log_decay(heads, layer.layer_idx, layer.num_hidden_layers)
    output, state = lightning_attention(query, key, value, log_decay, start)
    output = layer.norm(output.transpose(1, 2).reshape(batch, length, heads * head_dim))
    return layer.out_proj(torch.sigmoid(layer.output_gate(hidden)) * output), state


@pytest.mark.parametrize("layer_index", [0, 2])
def test_slopes_match_transformers(layer_index: int) -> None:
    _, layer = tiny_lightning_layer(layer_index)
    torch.testing.assert_close(minimax_log_decay(3, layer_index, 4), -layer.slope_rate[:, :, 0])


@pytest.mark.parametrize("length", [5, 40])
def test_matches_transformers_minimax_lightning_attention(length: int) -> None:
    """Prefill (transformers' block path, partial last block) and continuation from a cached state (its step path)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    config, layer = tiny_lightning_layer()
    hidden = torch.randn(2, length, config.hidden_size)
    with torch.no_grad():
        expected, expected_state = layer(hidden, position_embeddings=None, attention_mask=None)
        output, state = our_lightning_layer(layer, hidden, None)
        torch.testing.assert_close(output, expected, **TOLERANCE)
        torch.testing.assert_close(state, expected_state, **TOLERANCE)

        start = torch.randn(2, 3, 16, 16) * 0.3
        cache = MiniMaxCache()
        cache.set_linear_cache(layer.layer_idx, start.clone())
        expected, expected_state = layer(hidden, position_embeddings=None, attention_mask=None, cache=cache)
        output, state = our_lightning_layer(layer, hidden, start)
    torch.testing.assert_close(output, expected, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)
