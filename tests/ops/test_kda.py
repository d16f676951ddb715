"""Kimi Delta Attention: chunked and step paths against the naive float32 recurrence, carried states, the transition
matrix, and transformers' own torch path (kimi_linear, bailing_hybrid)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hypic_rag.runtime.ops.kda import chunk as kda_chunk_module
from hypic_rag.runtime.ops.kda import (
    chunk_kda,
    fused_recurrent_kda,
    kda,
    kda_with_transition,
    naive_recurrent_kda,
    select_kda_backend,
)

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def random_inputs(
    batch: int, heads: int, length: int, key_dim: int, value_dim: int, seed: int, decay_scale: float = 0.3
):
    generator = torch.Generator().manual_seed(seed)
    query = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1)
    query = query * key_dim**-0.5
    key = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1)
    value = torch.randn(batch, heads, length, value_dim, generator=generator)
    log_decay = -torch.rand(batch, heads, length, key_dim, generator=generator) * decay_scale
    beta = torch.rand(batch, heads, length, generator=generator)
    start = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return query, key, value, log_decay, beta, start


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 131])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_naive_on_odd_lengths(length: int, chunk_size: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 3, length, 16, 8, seed=length)
    expected_output, expected_state = naive_recurrent_kda(query, key, value, log_decay, beta, start)
    output, state = chunk_kda(query, key, value, log_decay, beta, start, chunk_size=chunk_size)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


def test_chunk_is_stable_with_strong_per_channel_decay() -> None:
    """Some channels decay by up to e^-30 per token (cumulative e^-1900 over a chunk), others barely at all."""
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 100, 8, 8, seed=3)
    log_decay = log_decay * torch.tensor([100.0, 0.01] * 4)  # alternate very fast and very slow channels
    expected_output, expected_state = naive_recurrent_kda(query, key, value, log_decay, beta, start)
    output, state = chunk_kda(query, key, value, log_decay, beta, start, chunk_size=64)
    assert torch.isfinite(output).all() and torch.isfinite(state).all()
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


def test_chunk_groups_under_a_small_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 90, 8, 4, seed=8)
    expected_output, expected_state = chunk_kda(query, key, value, log_decay, beta, start, chunk_size=16)
    monkeypatch.setattr(kda_chunk_module, "PAIRWISE_BUDGET", 2 * 16 * 16 * 8 * 2)  # two chunks per group
    output, state = chunk_kda(query, key, value, log_decay, beta, start, chunk_size=16)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


@pytest.mark.parametrize("cuts", [(1,), (17, 40), (5, 20, 50)])
def test_split_sequence_carries_state(cuts: tuple[int, ...]) -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 57, 8, 8, seed=11)
    whole_output, whole_state = chunk_kda(query, key, value, log_decay, beta, start, chunk_size=16)
    bounds = [0, *cuts, 57]
    state, pieces = start, []
    for begin, end in itertools.pairwise(bounds):
        piece = (x[:, :, begin:end] for x in (query, key, value, log_decay, beta))
        output, state = kda(*piece, state, chunk_size=16)
        pieces.append(output)
    torch.testing.assert_close(torch.cat(pieces, dim=2), whole_output, **TOLERANCE)
    torch.testing.assert_close(state, whole_state, **TOLERANCE)


@pytest.mark.parametrize("length", [1, 29, 70])
def test_transition_matrix_reproduces_any_start(length: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 2, length, 12, 6, seed=5)
    zero_output, transition_output, span = kda_with_transition(query, key, value, log_decay, beta, chunk_size=16)
    expected_output, expected_state = naive_recurrent_kda(query, key, value, log_decay, beta, start)
    assert span.transition.shape == (2, 2, 12, 12) and span.state.shape == (2, 2, 12, 6)
    torch.testing.assert_close(span.apply(start), expected_state, **TOLERANCE)
    torch.testing.assert_close(zero_output + transition_output @ start, expected_output, **TOLERANCE)
    zero_start_output, zero_start_state = naive_recurrent_kda(query, key, value, log_decay, beta)
    torch.testing.assert_close(span.state, zero_start_state, **TOLERANCE)
    torch.testing.assert_close(zero_output, zero_start_output, **TOLERANCE)


def test_transition_matrix_is_the_product_of_token_transitions() -> None:
    """P = A_T ... A_1 with A_t = (I - b_t k_t k_t^T) Diag(exp(g_t)), built directly for a short span."""
    query, key, value, log_decay, beta, _ = random_inputs(1, 1, 6, 5, 3, seed=9)
    _, _, span = kda_with_transition(query, key, value, log_decay, beta)
    product = torch.eye(5)
    for t in range(6):
        k_t = key[0, 0, t]
        step = (torch.eye(5) - beta[0, 0, t] * torch.outer(k_t, k_t)) @ torch.diag(log_decay[0, 0, t].exp())
        product = step @ product
    torch.testing.assert_close(span.transition[0, 0], product, **TOLERANCE)


def test_composed_spans_equal_the_whole() -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 48, 8, 4, seed=12)
    spans = [kda_with_transition(*(x[:, :, a:b] for x in (query, key, value, log_decay, beta)))[2]
             for a, b in ((0, 10), (10, 31), (31, 48))]
    composed = spans[0].then(spans[1]).then(spans[2])
    torch.testing.assert_close(composed.apply(start), naive_recurrent_kda(query, key, value, log_decay, beta, start)[1],
                               **TOLERANCE)


@pytest.mark.parametrize("length", [0, 1, 3, 9])
def test_recurrent_matches_naive_and_keeps_its_input_state(length: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 3, length, 16, 8, seed=20 + length)
    start_copy = start.clone()
    expected_output, expected_state = naive_recurrent_kda(query, key, value, log_decay, beta, start)
    output, state = fused_recurrent_kda(query, key, value, log_decay, beta, start)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)
    assert torch.equal(start, start_copy)


@pytest.mark.parametrize("length, backend", [(1, "recurrent"), (4, "recurrent"), (5, "chunk"), (70, "chunk")])
def test_dispatch_picks_a_backend_by_length_and_matches_naive(length: int, backend: str) -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, length, 8, 8, seed=40 + length)
    assert select_kda_backend(query) == backend
    expected_output, expected_state = naive_recurrent_kda(query, key, value, log_decay, beta, start)
    output, state = kda(query, key, value, log_decay, beta, start)
    torch.testing.assert_close(output, expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
@pytest.mark.parametrize("length", [1, 50])
def test_matches_transformers_torch_path(family: str, length: int) -> None:
    """transformers' own KDA functions (token-major [B, T, H, D], l2-normalising q and k and scaling q inside)."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    generator = torch.Generator().manual_seed(length)
    batch, heads, key_dim = 2, 3, 16
    raw_query, raw_key = (torch.randn(batch, length, heads, key_dim, generator=generator) for _ in range(2))
    value = torch.randn(batch, length, heads, key_dim, generator=generator)
    log_decay = -torch.rand(batch, length, heads, key_dim, generator=generator) * 2.0
    beta = torch.rand(batch, length, heads, generator=generator)
    start = torch.randn(batch, heads, key_dim, key_dim, generator=generator)
    run = modeling.recurrent_kimi_delta_attention if length == 1 else modeling.chunk_kimi_delta_attention
    expected_output, expected_state = run(
        raw_query, raw_key, value, g=log_decay, beta=beta, initial_state=start.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )

    def head_major(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)

    query = modeling.l2norm(raw_query) * key_dim**-0.5
    key = modeling.l2norm(raw_key)
    output, state = kda(*map(head_major, (query, key, value, log_decay)), head_major(beta), start)
    torch.testing.assert_close(head_major(output), expected_output, **TOLERANCE)
    torch.testing.assert_close(state, expected_state, **TOLERANCE)
