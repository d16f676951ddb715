"""The batched pass's fast paths against the plain code beside them (fp32, 1e-5): the recurrent layers' decode
steps of every item at once, `packed` scans and `mapped` runs (`recurrent_pass.FAST_PATHS`) against every item
stepped through the wavefront; the cached maps of several items in one batched product against one at a time; the
last block on each item's last token only against every row. Mixed batches: prefills of every mode (hypic: seams
and question; prefix: checkpoints; addition) with a decode step among them, for recurrent mixers of every kind."""

from __future__ import annotations

import random

import pytest
import torch

from hypic_rag.entry.schema import SEAM_TOKENS, tensor_name
from hypic_rag.runtime import recurrent_pass
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.layout import Layout, Span, StackItem
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import decode_batch, run_batch
from hypic_rag.testing import build_tiny_model

ATOL = 1e-5
FAMILIES = ("qwen3_5", "qwen3_next", "granitemoehybrid", "kimi_linear", "jamba", "minimax", "lfm2")
"""Gated DeltaNet (packed on CPU) twice, SSD, KDA, Mamba1, lightning, short conv (no state)."""


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return wrap_model(build_tiny_model(request.param, seed=7))


def _copy(state: SequenceState) -> SequenceState:
    copy = SequenceState(state.length, dict(state.linear))
    copy.keys = {layer: keys.clone() for layer, keys in state.keys.items()}
    copy.values = {layer: values.clone() for layer, values in state.values.items()}
    return copy


def _ids(generator: torch.Generator, model, count: int) -> list[int]:
    vocab = model.hf_model.config.get_text_config().vocab_size
    return torch.randint(0, min(vocab, 256), (count,), generator=generator).tolist()


def _decode_among_prefills(model, requests: list[Request], token: int):
    """(a running sequence after requests[0]'s hypic prefill, items(state) -> one decode step of `token` from that
    state followed by the prefill of every request in every mode): the mixed batch the fast-path tests compare."""
    engine = Engine(model, seam_tokens=4)
    running = run_batch(model, [engine.plan_prefill(requests[0], "hypic").item(reserve=2)])[0].state
    plans = [engine.plan_prefill(request, mode) for request in requests for mode in MODES]

    def items(decoding: SequenceState) -> list[StackItem]:
        return [StackItem([Span([token], decoding.length, 1)], decoding)] + [plan.item() for plan in plans]

    return running, items


def _assert_same(got, want) -> None:
    torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
    assert got.state.length == want.state.length
    for layer_index, linear in want.state.linear.items():
        torch.testing.assert_close(got.state.linear[layer_index].recurrent, linear.recurrent, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got.state.linear[layer_index].conv_tail, linear.conv_tail, atol=ATOL, rtol=1e-5)
    length = want.state.length
    for layer_index, keys in want.state.keys.items():
        torch.testing.assert_close(got.state.keys[layer_index][:, :length], keys[:, :length], atol=ATOL, rtol=0)
        torch.testing.assert_close(got.state.values[layer_index][:, :length],
                                   want.state.values[layer_index][:, :length], atol=ATOL, rtol=0)
    assert len(got.checkpoints) == len(want.checkpoints)
    for got_checkpoint, want_checkpoint in zip(got.checkpoints, want.checkpoints):
        for layer_index, linear in want_checkpoint.linear.items():
            torch.testing.assert_close(got_checkpoint.linear[layer_index].recurrent, linear.recurrent,
                                       atol=ATOL, rtol=1e-5)


def test_decode_steps_of_all_sequences_at_once_equal_the_walk(model, monkeypatch) -> None:
    generator = torch.Generator().manual_seed(0)
    engine = Engine(model, seam_tokens=4)
    requests = [Request(_ids(generator, model, 3), [_ids(generator, model, 9), _ids(generator, model, 14)],
                        _ids(generator, model, n)) for n in (2, 5, 7)]
    prefilled = run_batch(model, [engine.plan_prefill(request, "hypic").item(reserve=4) for request in requests])
    fast_states = [result.state for result in prefilled]
    slow_states = [_copy(state) for state in fast_states]
    assert len({state.length for state in fast_states}) == 3
    for _ in range(4):
        tokens = _ids(generator, model, len(requests))
        fast = decode_batch(model, fast_states, tokens)
        with monkeypatch.context() as patch:
            patch.setattr(recurrent_pass, "FAST_PATHS", False)
            slow = decode_batch(model, slow_states, tokens)
        torch.testing.assert_close(fast, slow, atol=ATOL, rtol=0)
        for fast_state, slow_state in zip(fast_states, slow_states):
            for layer_index, linear in fast_state.linear.items():
                torch.testing.assert_close(linear.recurrent, slow_state.linear[layer_index].recurrent, atol=ATOL, rtol=0)
                torch.testing.assert_close(linear.conv_tail, slow_state.linear[layer_index].conv_tail, atol=ATOL, rtol=0)


def test_a_prefill_item_is_not_taken_for_a_decode_step() -> None:
    layout = Layout(StackItem([Span([3, 4, 5], 2, 3)]), [Span([3, 4, 5], 2, 3)], [(0, 3)], 0, 2, 5, 3, torch.zeros(3))
    assert not layout.is_decode_step()
    single = Span([3], 2, 1)
    assert Layout(StackItem([single]), [single], [(0, 1)], 0, 2, 3, 1, torch.zeros(1)).is_decode_step()
    assert not Layout(StackItem([single], want_checkpoints=True), [single], [(0, 1)], 0, 2, 3, 1,
                      torch.zeros(1)).is_decode_step()


@pytest.mark.parametrize("composition", ["transition", "addition"])
def test_cached_maps_applied_together_equal_one_at_a_time(composition: str) -> None:
    generator = torch.Generator().manual_seed(1)
    heads, key_dim, value_dim, layer = 3, 5, 4, 2

    def entry() -> dict[str, torch.Tensor]:
        return {tensor_name(layer, "transition"): torch.randn(heads, key_dim, key_dim, generator=generator),
                tensor_name(layer, "suffix_state"): torch.randn(heads, key_dim, value_dim, generator=generator),
                SEAM_TOKENS: torch.tensor(0)}

    mode = "addition" if composition == "addition" else "hypic"
    starts = [torch.randn(heads, key_dim, value_dim, generator=generator) for _ in range(3)]
    cached = [[(entry(), 0) for _ in range(count)] for count in (2, 1, 3)]

    def walks() -> list:
        made = []
        for start in starts:
            item = StackItem([Span([1], 0, 1)], assembly=Assembly(mode))
            layout = Layout(item, item.spans, [(0, 1)], 0, 0, 1, 1, torch.zeros(1))
            made.append(recurrent_pass._Walk(layout, [], [], [], torch.zeros(0), start))
        return made

    together = walks()
    steps = [recurrent_pass._Step(0, cached=maps) for maps in cached]
    recurrent_pass._apply_cached_steps(together, steps, layer, "matrix")
    for walk, start, maps in zip(together, starts, cached):
        alone = recurrent_pass.apply_cached_maps(start, maps, layer, composition, "matrix")
        torch.testing.assert_close(walk.state, alone, atol=ATOL, rtol=1e-5)
        expected = start
        for cached_entry, _ in maps:  # the definition: S <- P S + Z (S + Z in addition), span by span
            suffix = cached_entry[tensor_name(layer, "suffix_state")]
            transition = cached_entry[tensor_name(layer, "transition")]
            expected = expected + suffix if composition == "addition" else transition @ expected + suffix
        torch.testing.assert_close(walk.state, expected, atol=1e-4, rtol=1e-5)
        assert walk.layout.compose_seconds > 0


def _requests(model, seed: int, count: int) -> list[Request]:
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pool = [_ids(generator, model, rng.randint(3, 30)) for _ in range(6)]
    return [Request(_ids(generator, model, rng.randint(0, 5)), [rng.choice(pool) for _ in range(rng.randint(1, 5))],
                    _ids(generator, model, rng.randint(1, 9))) for _ in range(count)]


def test_the_fast_ways_equal_the_wavefront(model, monkeypatch) -> None:
    """Prefills of every mode with a decode step among them: logits, end states and span checkpoints of the fast
    ways (packed, mapped, decode steps) equal every item stepped through the wavefront."""
    running, items = _decode_among_prefills(model, _requests(model, 3, 3), token=5)
    fast = run_batch(model, items(_copy(running)))
    with monkeypatch.context() as patch:
        patch.setattr(recurrent_pass, "FAST_PATHS", False)
        slow = run_batch(model, items(_copy(running)))
    for got, want in zip(fast, slow):
        _assert_same(got, want)


@pytest.mark.parametrize("prefills", [1, 3])
def test_packed_for_a_lone_prefill_the_wavefront_for_several(model, monkeypatch, prefills: int) -> None:
    """One hypic prefill among decode steps takes the packed scan (a mixer that `scans_runs`); several go through the
    mapped runs and the wavefront together. Either way equal to the plain wavefront."""
    running, _ = _decode_among_prefills(model, _requests(model, 1, 3), token=5)
    engine = Engine(model, seam_tokens=4)
    plans = [engine.plan_prefill(request, "hypic") for request in _requests(model, 11, prefills)]

    def items(decoding: SequenceState) -> list[StackItem]:
        return [StackItem([Span([5], decoding.length, 1)], decoding)] + [plan.item() for plan in plans]

    packed_walks: list[int] = []
    original = recurrent_pass._run_packed

    def counting(*args, **kwargs):
        packed_walks.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(recurrent_pass, "_run_packed", counting)
    fast = run_batch(model, items(_copy(running)))
    scans = next(block.recurrent for block in model.blocks if block.recurrent is not None).scans_runs
    assert bool(packed_walks) == (scans and prefills == 1)
    with monkeypatch.context() as patch:
        patch.setattr(recurrent_pass, "FAST_PATHS", False)
        slow = run_batch(model, items(_copy(running)))
    for got, want in zip(fast, slow):
        _assert_same(got, want)


def test_the_last_block_for_the_last_tokens_only_equals_every_row(model) -> None:
    """Trimming the last block to each item's last token changes no logits and no state (keys, values, recurrent
    states of every token are still written), for prefills of every mode with a decode among them."""
    generator = torch.Generator().manual_seed(4)
    requests = [Request(_ids(generator, model, 2), [_ids(generator, model, 11), _ids(generator, model, 6)],
                        _ids(generator, model, n)) for n in (1, 4)]
    running, items = _decode_among_prefills(model, requests, token=7)
    fast = run_batch(model, items(_copy(running)))
    slow = run_batch(model, items(_copy(running)), want_all_logits=True)
    for got, want in zip(fast, slow):
        _assert_same(got, want)
        torch.testing.assert_close(want.all_logits[-1], want.logits, atol=0, rtol=0)


@pytest.mark.parametrize("counts", [[5, 5, 5], [3, 8, 1, 8], [7], "whole"])
def test_a_run_gather_equals_gather_runs(counts: list[int] | str) -> None:
    """`RunGather` (the windows' gather made once per pass, two operations per tensor) against `gather_runs` (a copy
    per run): equal, zeros past each run's end, for tensors of several trailing shapes."""
    generator = torch.Generator().manual_seed(len(counts))
    if counts == "whole":  # the one run is every row: a view
        counts, rows, starts = [9], 9, [0]
    else:
        rows = sum(counts) + 4
        starts = [2 + sum(counts[:number]) for number in range(len(counts))]
    windows = list(zip(starts, counts))
    gather = recurrent_pass.RunGather.of(windows, rows, torch.device("cpu"))
    for shape in ((rows,), (rows, 6), (rows, 3, 4)):
        values = torch.randn(*shape, generator=generator)
        got = gather(values)
        assert torch.equal(got, recurrent_pass.gather_runs(values, windows))
        assert (got.data_ptr() == values.data_ptr()) == (rows == counts[0])  # the whole: a view, no copy
        for number, count in enumerate(counts):
            assert not got[number, count:].any()
