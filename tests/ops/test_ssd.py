"""Chunked SSD (Mamba2) against the naive float32 recurrence: odd lengths, groups, carried states, transitions."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.ops.ssd import (
    apply_ssd_transition,
    chunk_ssd,
    compose_ssd_transitions,
    naive_ssd,
    recurrent_ssd,
    select_backend,
    ssd,
    ssd_varlen,
    ssd_with_transition,
)
from hypic_rag.runtime.ops.time_step import softplus_time_step


def random_inputs(batch: int, heads: int, groups: int, length: int, head_dim: int, state_size: int, seed: int,
                  strong_decay: bool = False):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, heads, length, head_dim, generator=generator)
    raw = torch.randn(batch, length, heads, generator=generator) * (3.0 if strong_decay else 1.0)  # model layout
    dt = softplus_time_step(raw, torch.linspace(-1.0, 1.0, heads), limit=(0.001, 100.0)).transpose(1, 2)
    a = -torch.linspace(0.5, 16.0 if strong_decay else 2.0, heads)
    b = torch.randn(batch, groups, length, state_size, generator=generator) * state_size**-0.5
    c = torch.randn(batch, groups, length, state_size, generator=generator) * state_size**-0.5
    d = torch.randn(heads, generator=generator)
    start = torch.randn(batch, heads, state_size, head_dim, generator=generator)
    return x, dt, a, b, c, d, start


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 131])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunk_matches_naive_on_odd_lengths_and_groupings(length: int, chunk_size: int, groups: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 4, groups, length, 8, 6, seed=length + groups)
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    output, state = chunk_ssd(x, dt, a, b, c, d, start, chunk_size=chunk_size)
    assert output.shape == (2, 4, length, 8) and state.shape == (2, 4, 6, 8)
    close(output, expected_output)
    close(state, expected_state)


def test_groups_matter_and_without_skip_the_output_is_the_pure_scan() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 4, 2, 20, 4, 5, seed=1)
    grouped_output, _ = chunk_ssd(x, dt, a, b, c, None, start, chunk_size=8)
    # head h reads group h // 2: swapping the groups changes heads 0-1 and 2-3
    swapped_output, _ = chunk_ssd(x, dt, a, b.flip(1), c.flip(1), None, start, chunk_size=8)
    assert not torch.allclose(grouped_output, swapped_output)
    close(grouped_output, naive_ssd(x, dt, a, b, c, None, start)[0])
    skip_output, _ = chunk_ssd(x, dt, a, b, c, d, start, chunk_size=8)
    close(skip_output - grouped_output, d[None, :, None, None] * x)


def test_chunk_is_stable_with_strong_decay() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 3, 1, 100, 8, 8, seed=3, strong_decay=True)
    assert (dt * a[None, :, None]).min() < -40  # whole chunks decay to exactly zero in float32
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    output, state = chunk_ssd(x, dt, a, b, c, d, start, chunk_size=32)
    assert torch.isfinite(output).all() and torch.isfinite(state).all()
    close(output, expected_output)
    close(state, expected_state)


@pytest.mark.parametrize("cuts", [[1], [17], [40, 41], [5, 23, 50]])
def test_split_sequence_carries_state(cuts: list[int]) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 4, 2, 57, 8, 6, seed=11)
    whole_output, whole_state = chunk_ssd(x, dt, a, b, c, d, start, chunk_size=16)
    state, pieces = start, []
    for begin, end in zip([0, *cuts], [*cuts, 57]):
        piece, state = ssd(x[:, :, begin:end], dt[:, :, begin:end], a, b[:, :, begin:end], c[:, :, begin:end], d,
                           state, chunk_size=16)
        pieces.append(piece)
    close(torch.cat(pieces, dim=2), whole_output)
    close(state, whole_state)


@pytest.mark.parametrize("length", [1, 29, 70])
def test_transition_is_a_scalar_per_head_and_reproduces_any_start(length: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 4, 2, length, 6, 5, seed=5)
    zero_output, output_transition, transition, state = ssd_with_transition(x, dt, a, b, c, d, chunk_size=16)
    assert transition.shape == (2, 4) and state.shape == (2, 4, 5, 6) and output_transition.shape == (2, 4, length, 5)
    close(transition, torch.exp((dt * a[None, :, None]).sum(-1)))
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    zero_start_output, zero_start_state = naive_ssd(x, dt, a, b, c, d)
    close(state, zero_start_state)
    close(zero_output, zero_start_output)
    # S_end(S_0) == P * S_0 + S_end(0), and the outputs from S_0 without rerunning the span
    close(apply_ssd_transition(transition, state, start), expected_state)
    close(zero_output + output_transition @ start, expected_output)


def test_transitions_compose_over_random_chunks() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 4, 1, 90, 4, 4, seed=9)
    generator = torch.Generator().manual_seed(2)
    cuts = sorted(torch.randperm(88, generator=generator)[:4].add(1).tolist())
    composed = None
    for begin, end in zip([0, *cuts], [*cuts, 90]):
        _, _, transition, state = ssd_with_transition(*(t[:, :, begin:end] for t in (x, dt)), a,
                                                      *(t[:, :, begin:end] for t in (b, c)), d, chunk_size=16)
        composed = (transition, state) if composed is None else compose_ssd_transitions(composed, (transition, state))
    close(apply_ssd_transition(*composed, start), naive_ssd(x, dt, a, b, c, d, start)[1])


def test_empty_span_is_identity() -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 2, 1, 0, 4, 3, seed=0)
    output, _, transition, state = ssd_with_transition(x, dt, a, b, c, d)
    assert output.shape == (1, 2, 0, 4)
    torch.testing.assert_close(apply_ssd_transition(transition, state, start), start)
    torch.testing.assert_close(chunk_ssd(x, dt, a, b, c, d, start)[1], start)


@pytest.mark.parametrize("length", [0, 1, 3, 9])
def test_recurrent_matches_naive_and_keeps_its_input_state(length: int) -> None:
    x, dt, a, b, c, d, start = random_inputs(2, 4, 2, length, 8, 6, seed=20 + length)
    start_copy = start.clone()
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    output, state = recurrent_ssd(x, dt, a, b, c, d, start)
    close(output, expected_output)
    close(state, expected_state)
    assert torch.equal(start, start_copy)
    close(recurrent_ssd(x, dt, a, b, c, d)[1], naive_ssd(x, dt, a, b, c, d)[1])


@pytest.mark.parametrize("length, backend", [(1, "recurrent"), (4, "recurrent"), (5, "chunk"), (70, "chunk")])
def test_dispatch_picks_a_backend_by_length_and_matches_naive(length: int, backend: str) -> None:
    x, dt, a, b, c, d, start = random_inputs(1, 2, 1, length, 8, 8, seed=40 + length)
    assert select_backend(x) == backend
    expected_output, expected_state = naive_ssd(x, dt, a, b, c, d, start)
    output, state = ssd(x, dt, a, b, c, d, start)
    close(output, expected_output)
    close(state, expected_state)


def test_varlen_and_right_padded_batches_give_each_sequence_its_own_state() -> None:
    lengths = [9, 0, 30, 4]
    x, dt, a, b, c, d, starts = random_inputs(1, 4, 2, sum(lengths), 4, 3, seed=7)
    starts = torch.randn(len(lengths), 4, 3, 4, generator=torch.Generator().manual_seed(8))
    bounds = [0, 9, 9, 39, 43]
    output, finals = ssd_varlen(x, dt, a, b, c, bounds, d, starts)
    width = max(lengths)
    padded = [torch.zeros(len(lengths), *t.shape[1:2], width, *t.shape[3:]) for t in (x, dt, b, c)]
    for number, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        expected_output, expected_state = naive_ssd(x[:, :, begin:end], dt[:, :, begin:end], a, b[:, :, begin:end],
                                                    c[:, :, begin:end], d, starts[number : number + 1])
        close(output[:, :, begin:end], expected_output)
        close(finals[number : number + 1], expected_state)
        for target, source in zip(padded, (x, dt, b, c)):
            target[number, :, : end - begin] = source[0, :, begin:end]
    # right-padding with dt = 0 (and x = 0) leaves each row's state as its sequence left it
    batch_output, batch_finals = chunk_ssd(padded[0], padded[1], a, padded[2], padded[3], d, starts, chunk_size=8)
    close(batch_finals, finals)
    close(batch_output[2, :, :30], output[0, :, 9:39])
    with pytest.raises(ValueError, match="cu_seqlens"):
        ssd_varlen(x, dt, a, b, c, [0, 5, 3, 43], d)
