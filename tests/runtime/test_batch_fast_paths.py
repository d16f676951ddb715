"""The batched pass's fast paths against the general code beside them (fp32, 1e-5): a decode step of every
Gated DeltaNet layer at once (`_linear_decode_steps`) against the walk over spans, and the cached maps of several
sequences in one batched product (`_apply_cached_together`) against one at a time (`_apply_cached`)."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.entry import tensor_name
from hypic_rag.runtime import batch
from hypic_rag.runtime.batch import BatchItem, decode_batch, run_batch
from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import StackOptions
from hypic_rag.testing import build_tiny_model

ATOL = 1e-5


@pytest.fixture(scope="module", params=("qwen3_5", "qwen3_next"))
def model(request):
    return wrap_model(build_tiny_model(request.param, seed=7))


def _copy(state: SequenceState) -> SequenceState:
    copy = SequenceState(state.length, dict(state.linear))
    copy.keys = {layer: keys.clone() for layer, keys in state.keys.items()}
    copy.values = {layer: values.clone() for layer, values in state.values.items()}
    return copy



def _decode_among_prefills(model, requests: list[Request], token: int):
    """(a running sequence after requests[0]'s hypic prefill, items(state) -> one decode step of `token` from that
    state followed by the prefill of every request in every mode): the mixed batch the fast-path tests compare."""
    from hypic_rag.runtime.modes import MODES

    engine = Engine(model, seam_tokens=4)
    running = run_batch(model, [BatchItem(plan.spans, plan.initial, plan.options, reserve=2) for plan in
                                [engine.plan_prefill(requests[0], "hypic")]])[0].state
    plans = [engine.plan_prefill(request, mode) for request in requests for mode in MODES]

    def items(decoding: SequenceState) -> list[BatchItem]:
        return [BatchItem([batch.Span([token], decoding.length, 1)], decoding)] + [
            BatchItem(plan.spans, plan.initial, plan.options, plan.want_checkpoints) for plan in plans]

    return running, items

def test_decode_steps_of_all_sequences_at_once_equal_the_walk(model, monkeypatch) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = lambda count: torch.randint(0, 256, (count,), generator=generator).tolist()  # noqa: E731
    engine = Engine(model, seam_tokens=4)
    requests = [Request(ids(3), [ids(9), ids(14)], ids(n)) for n in (2, 5, 7)]
    plans = [engine.plan_prefill(request, "hypic") for request in requests]
    prefilled = run_batch(model, [BatchItem(plan.spans, plan.initial, plan.options, reserve=4) for plan in plans])
    fast_states = [result.state for result in prefilled]
    slow_states = [_copy(state) for state in fast_states]
    assert len({state.length for state in fast_states}) == 3
    for step in range(4):
        tokens = ids(len(requests))
        assert batch._all_decode_steps(batch._lay_out(
            [BatchItem([batch.Span([t], s.length, 1)], s) for s, t in zip(fast_states, tokens)], model.device)[0],
            next(i for i, kind in enumerate(model.layer_types) if kind == batch.LINEAR_LAYER))
        fast = decode_batch(model, fast_states, tokens)
        with monkeypatch.context() as patch:
            patch.setattr(batch, "_all_decode_steps", lambda layouts, layer_index: False)
            slow = decode_batch(model, slow_states, tokens)
        torch.testing.assert_close(fast, slow, atol=ATOL, rtol=0)
        for fast_state, slow_state in zip(fast_states, slow_states):
            for layer_index, linear in fast_state.linear.items():
                torch.testing.assert_close(linear.recurrent, slow_state.linear[layer_index].recurrent, atol=ATOL, rtol=0)
                torch.testing.assert_close(linear.conv_tail, slow_state.linear[layer_index].conv_tail, atol=ATOL, rtol=0)


def test_a_prefill_item_is_not_taken_for_a_decode_step(model) -> None:
    engine = Engine(model, seam_tokens=4)
    plan = engine.plan_prefill(Request([1, 2], [[3, 4, 5, 6, 7]], [8]), "hypic")
    layouts, _ = batch._lay_out([BatchItem(plan.spans, plan.initial, plan.options)], model.device)
    assert not batch._all_decode_steps(layouts, 0)


@pytest.mark.parametrize("composition", ["transition", "addition"])
def test_cached_maps_applied_together_equal_one_at_a_time(composition: str) -> None:
    generator = torch.Generator().manual_seed(1)
    heads, key_dim, value_dim, layer = 3, 5, 4, 2

    def entry() -> dict[str, torch.Tensor]:
        return {tensor_name(layer, "transition"): torch.randn(heads, key_dim, key_dim, generator=generator),
                tensor_name(layer, "suffix_state"): torch.randn(heads, key_dim, value_dim, generator=generator)}

    states = [torch.randn(heads, key_dim, value_dim, generator=generator) for _ in range(4)]
    mapped = [(0, entry()), (2, entry()), (3, entry())]
    layouts = [batch._Layout(BatchItem([], options=StackOptions(composition=composition)), [], [], 0, 0, 0, 0,
                             torch.zeros(0)) for _ in states]
    expected = list(states)
    for number, cached in mapped:
        expected[number] = batch._apply_cached(states[number], cached, layer, composition)
    together = list(states)
    batch._apply_cached_together(together, mapped, layer, layouts)
    for got, want, before in zip(together, expected, states):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    assert together[1] is states[1]


def test_runs_in_parallel_through_affine_maps_equal_the_wavefront(model, monkeypatch) -> None:
    """Prefills of every mode (hypic: seams and question; prefix: checkpoints; addition) together, with a decode
    step among them: logits, end states and span checkpoints equal the step-by-step wavefront's."""
    import random


    generator = torch.Generator().manual_seed(3)
    rng = random.Random(3)
    ids = lambda count: torch.randint(0, 256, (count,), generator=generator).tolist()  # noqa: E731
    pool = [ids(rng.randint(3, 30)) for _ in range(6)]
    requests = [Request(ids(rng.randint(0, 5)), [rng.choice(pool) for _ in range(rng.randint(1, 5))], ids(rng.randint(1, 9)))
                for _ in range(3)]
    running, items = _decode_among_prefills(model, requests, token=5)

    with monkeypatch.context() as patch:
        patch.setattr(batch, "PARALLEL_RUNS", True)
        fast = run_batch(model, items(_copy(running)))
    with monkeypatch.context() as patch:
        patch.setattr(batch, "PARALLEL_RUNS", False)
        slow = run_batch(model, items(_copy(running)))
    for got, want in zip(fast, slow):
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
        for layer_index, linear in want.state.linear.items():
            torch.testing.assert_close(got.state.linear[layer_index].recurrent, linear.recurrent, atol=ATOL, rtol=1e-5)
        assert len(got.checkpoints) == len(want.checkpoints)
        for got_checkpoint, want_checkpoint in zip(got.checkpoints, want.checkpoints):
            for layer_index, linear in want_checkpoint.linear.items():
                torch.testing.assert_close(got_checkpoint.linear[layer_index].recurrent, linear.recurrent,
                                           atol=ATOL, rtol=1e-5)


def test_the_last_layer_for_the_last_tokens_only_equals_every_row(model, monkeypatch) -> None:
    """Trimming the last layer to each item's last token changes no logits and no state (keys, values, recurrent
    states of every token are still written), for prefills of every mode with a decode among them."""

    generator = torch.Generator().manual_seed(4)
    ids = lambda count: torch.randint(0, 256, (count,), generator=generator).tolist()  # noqa: E731
    requests = [Request(ids(2), [ids(11), ids(6)], ids(n)) for n in (1, 4)]
    running, items = _decode_among_prefills(model, requests, token=7)

    assert batch.TRIM_LAST_LAYER
    fast = run_batch(model, items(_copy(running)))
    with monkeypatch.context() as patch:
        patch.setattr(batch, "TRIM_LAST_LAYER", False)
        slow = run_batch(model, items(_copy(running)))
    for got, want in zip(fast, slow):
        torch.testing.assert_close(got.logits, want.logits, atol=ATOL, rtol=0)
        assert got.state.length == want.state.length
        for layer_index, keys in want.state.keys.items():
            length = want.state.length
            torch.testing.assert_close(got.state.keys[layer_index][:, :length], keys[:, :length], atol=ATOL, rtol=0)
            torch.testing.assert_close(got.state.values[layer_index][:, :length], want.state.values[layer_index][:, :length],
                                       atol=ATOL, rtol=0)
        for layer_index, linear in want.state.linear.items():
            torch.testing.assert_close(got.state.linear[layer_index].recurrent, linear.recurrent, atol=ATOL, rtol=1e-5)
