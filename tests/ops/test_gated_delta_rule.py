"""Chunked gated delta rule against the naive float32 recurrence (fla-style: odd lengths, carried states)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    gated_delta_rule,
    gated_delta_rule_with_transition,
    naive_recurrent_gated_delta_rule,
    select_backend,
)


def random_inputs(batch: int, heads: int, length: int, key_dim: int, value_dim: int, seed: int, strong_decay: bool = False):
    generator = torch.Generator().manual_seed(seed)
    query = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1)
    query = query * key_dim**-0.5
    key = torch.nn.functional.normalize(torch.randn(batch, heads, length, key_dim, generator=generator), dim=-1)
    value = torch.randn(batch, heads, length, value_dim, generator=generator)
    scale = 8.0 if strong_decay else 0.2
    log_decay = -torch.rand(batch, heads, length, generator=generator) * scale
    beta = torch.rand(batch, heads, length, generator=generator)
    start = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return query, key, value, log_decay, beta, start


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 131])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_matches_naive_on_odd_lengths(length: int, chunk_size: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 3, length, 16, 8, seed=length)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    output, state = chunk_gated_delta_rule(query, key, value, log_decay, beta, start, chunk_size=chunk_size)
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_chunk_is_stable_with_strong_decay() -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 100, 8, 8, seed=3, strong_decay=True)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    output, state = chunk_gated_delta_rule(query, key, value, log_decay, beta, start, chunk_size=32)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 17, 40])
def test_split_sequence_carries_state(split: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 57, 8, 8, seed=11)
    whole_output, whole_state = chunk_gated_delta_rule(query, key, value, log_decay, beta, start, chunk_size=16)
    parts = [(x[:, :, :split], x[:, :, split:]) for x in (query, key, value, log_decay, beta)]
    first_output, middle = chunk_gated_delta_rule(*(p[0] for p in parts), start, chunk_size=16)
    second_output, end = chunk_gated_delta_rule(*(p[1] for p in parts), middle, chunk_size=16)
    torch.testing.assert_close(torch.cat([first_output, second_output], dim=2), whole_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, whole_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 29, 70])
def test_transition_operator_reproduces_any_start(length: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 2, length, 12, 6, seed=5)
    zero_output, transition_output, span = gated_delta_rule_with_transition(query, key, value, log_decay, beta, chunk_size=16)
    expected_output, expected_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    assert span.transition.shape == (2, 2, 12, 12) and span.state.shape == (2, 2, 12, 6)
    torch.testing.assert_close(span.apply(start), expected_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zero_output + transition_output @ start, expected_output, atol=1e-5, rtol=1e-5)
    zero_start_output, zero_start_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta)
    torch.testing.assert_close(span.state, zero_start_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(zero_output, zero_start_output, atol=1e-5, rtol=1e-5)


def test_empty_span_is_identity() -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, 0, 4, 3, seed=0)
    _, _, span = gated_delta_rule_with_transition(query, key, value, log_decay, beta)
    torch.testing.assert_close(span.apply(start), start)


@pytest.mark.parametrize("length", [0, 1, 3, 9])
def test_recurrent_matches_naive_and_keeps_its_input_state(length: int) -> None:
    query, key, value, log_decay, beta, start = random_inputs(2, 3, length, 16, 8, seed=20 + length)
    start_copy = start.clone()
    expected_output, expected_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    output, state = fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(start, start_copy)
    zero_output, zero_state = fused_recurrent_gated_delta_rule(query, key, value, log_decay, beta, None)
    torch.testing.assert_close(zero_state, naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta)[1],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length, backend", [(1, "recurrent"), (4, "recurrent"), (5, "chunk"), (70, "chunk")])
def test_dispatch_picks_a_backend_by_length_and_matches_naive(length: int, backend: str) -> None:
    query, key, value, log_decay, beta, start = random_inputs(1, 2, length, 8, 8, seed=40 + length)
    assert select_backend(query) == backend
    expected_output, expected_state = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta, start)
    output, state = gated_delta_rule(query, key, value, log_decay, beta, start)
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [1, 2, 8, 17, 64])
def test_unit_lower_inverse_matches_triangular_solve(size: int) -> None:
    """The forward-substitution inverse equals torch's triangular solve against the identity (fp32)."""
    from hypic_rag.runtime.ops.gated_delta_rule.chunk import unit_lower_inverse

    generator = torch.Generator().manual_seed(size)
    strictly_lower = (torch.randn(3, 4, size, size, generator=generator) * 0.3).tril(-1)
    identity = torch.eye(size).expand(3, 4, size, size)
    expected = torch.linalg.solve_triangular(strictly_lower + identity, identity, upper=False, unitriangular=True)
    exact = torch.linalg.solve_triangular(
        (strictly_lower + identity).double(), identity.double(), upper=False, unitriangular=True
    )
    got = unit_lower_inverse(strictly_lower)
    # entries of a random 64 x 64 inverse reach ~30: float32 round-off is relative to that magnitude (the triangular
    # solve itself is 2.6e-6 off the float64 inverse there)
    scale = float(exact.abs().max())
    torch.testing.assert_close(got.double(), exact, atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(expected.double(), exact, atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(got @ (strictly_lower + identity), identity, atol=1e-6 * scale, rtol=1e-5)
    with_gradient = strictly_lower.clone().requires_grad_(True)  # the training path: differentiable
    inverse = unit_lower_inverse(with_gradient)
    torch.testing.assert_close(inverse, expected, atol=1e-6 * scale, rtol=1e-5)
    inverse.sum().backward()
    assert with_gradient.grad is not None and torch.isfinite(with_gradient.grad).all()


@pytest.mark.parametrize("lengths", [[5, 8, 3, 13], [1], [8, 8, 8, 24], [70, 3, 130], [8, 8]])
def test_packed_runs_scan_matches_the_naive_recurrence_with_maps_between_runs(lengths: list[int]) -> None:
    """`chunk_gated_delta_rule_packed`: runs packed end to end, an affine map applied before each run, equal the
    naive recurrence run after run."""
    from hypic_rag.runtime.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_packed

    query, key, value, log_decay, beta, _ = random_inputs(1, 3, sum(lengths), 8, 6, seed=sum(lengths))
    generator = torch.Generator().manual_seed(7)
    transitions = torch.randn(len(lengths), 3, 8, 8, generator=generator) * 0.3
    shifts = torch.randn(len(lengths), 3, 8, 6, generator=generator)
    start = torch.randn(3, 8, 6, generator=generator)

    def before_run(run: int, state: torch.Tensor) -> torch.Tensor:
        return transitions[run] @ state + shifts[run]

    outputs, end = chunk_gated_delta_rule_packed(query, key, value, log_decay, beta, lengths, start, before_run)
    state, first = start, 0
    for run, count in enumerate(lengths):
        state = before_run(run, state)
        pieces = [x[:, :, first : first + count] for x in (query, key, value, log_decay, beta)]
        expected, final = naive_recurrent_gated_delta_rule(*pieces, state[None])
        torch.testing.assert_close(outputs[:, :, first : first + count], expected, atol=1e-5, rtol=1e-5)
        state, first = final[0], first + count
    torch.testing.assert_close(end, state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [1, 3, 16])
def test_scan_with_blocked_outputs_matches_the_chunk_by_chunk_step(block: int) -> None:
    """`ChunkTerms.scan` (outputs batched `block` chunks at a time after the state loop) equals `step` chunk by
    chunk, also with a map applied to the state before some chunks (the packed scan's cached spans)."""
    from hypic_rag.runtime.ops.gated_delta_rule.chunk import chunk_terms

    query, key, value, log_decay, beta, _ = random_inputs(2, 3, 37, 5, 4, seed=block)
    generator = torch.Generator().manual_seed(block)
    terms = chunk_terms(query, key, value, log_decay, beta, 8)  # 5 chunks, the last padded
    start = torch.randn(6, 5, 4, generator=generator)
    maps = {1: (torch.randn(6, 5, 5, generator=generator) * 0.3, torch.randn(6, 5, 4, generator=generator)),
            4: (torch.randn(6, 5, 5, generator=generator) * 0.3, torch.randn(6, 5, 4, generator=generator))}

    def before_chunk(index: int, state: torch.Tensor) -> torch.Tensor:
        return state if index not in maps else torch.baddbmm(maps[index][1], maps[index][0], state)

    state, expected = start, []
    for index in range(terms.chunks):
        output, state = terms.step(index, before_chunk(index, state))
        expected.append(output)
    outputs, final = terms.scan(start, before_chunk, block=block)
    torch.testing.assert_close(outputs, torch.stack(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state, atol=1e-5, rtol=1e-5)
