"""Anchored entries (`runtime/anchoring.py`): a chunk's entry encoded after the prompt prefix, read through the
`+anchored` recompute policies. Exactness where it must hold (a chunk right after the prefix composes to `full`),
the entry view, the keys the engine, scheduler and precompute use, on a tiny random model."""

from __future__ import annotations

import functools

import pytest
import torch

from hypic_rag.entry.schema import SEAM_TOKENS, TOKEN_IDS, is_kv_name
from hypic_rag.runtime.anchoring import (
    MAX_ANCHOR_TOKENS,
    anchor_of,
    anchored_extra_bytes,
    anchored_key,
    chunk_view,
)
from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError
from hypic_rag.runtime.request import Request
from kits.corpora import random_request as shared_random_request
from hypic_rag.testing import build_tiny_model

SEAM = 4


random_request = functools.partial(shared_random_request, prefix=6, question=5)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=SEAM)


# ------------------------------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("spec", ["seam+anchored", "seam@0+anchored", "whole:2@8+anchored", "budget:1.5+anchored",
                                  "tokens:40@0+anchored"])
def test_an_anchored_spec_round_trips(spec: str) -> None:
    policy = RecomputePolicy.parse(spec)
    assert policy.anchored and policy.spec == spec
    assert RecomputePolicy.from_dict(policy.to_dict()) == policy
    assert policy.resolved(SEAM).anchored


@pytest.mark.parametrize("spec", ["seam+anchor", "+anchored", "seam@0+anchored+anchored", "seam+anchored@0",
                                  "whole+anchored", "seam +anchored"])
def test_a_bad_anchored_spec_is_a_one_line_error(spec: str) -> None:
    with pytest.raises(RecomputePolicyError) as raised:
        RecomputePolicy.parse(spec)
    assert "\n" not in str(raised.value)


def test_the_anchor_is_the_prefix_tail() -> None:
    assert anchor_of([]) == []
    assert anchor_of([3, 4, 5]) == [3, 4, 5]
    long = list(range(100))
    assert anchor_of(long) == long[-MAX_ANCHOR_TOKENS:]
    assert anchored_key([7, 8], [1, 2, 3], 4) == (6, (7, 8, 1, 2, 3))
    assert anchored_key([], [1, 2, 3], 4) == (4, (1, 2, 3))


# ------------------------------------------------------------------------------------------------------- entries
def test_the_chunk_view_is_the_chunks_rows_of_the_anchored_entry(engine: Engine) -> None:
    request = random_request(0, [12])
    anchor, chunk = anchor_of(request.prefix_ids), request.chunk_ids[0]
    seam, ids = anchored_key(anchor, chunk, 2)
    entry = engine.fetch_entries([list(ids)], seam, PrefillStats(mode="test"))[0]
    view = chunk_view(entry, len(anchor), 2)
    assert int(view[SEAM_TOKENS]) == 2 and view[TOKEN_IDS].tolist() == chunk
    for name, tensor in view.items():
        if is_kv_name(name):
            assert tensor.shape[1] == len(chunk)
            torch.testing.assert_close(tensor, entry[name][:, len(anchor):], atol=0, rtol=0)
        elif name not in (TOKEN_IDS, SEAM_TOKENS):
            assert tensor is entry[name]  # the suffix pair and conv tail already describe the chunk's suffix
    assert anchored_extra_bytes(entry, len(anchor)) == sum(
        t[:, :len(anchor)].numel() * t.element_size() for n, t in entry.items() if is_kv_name(n)) + 8 * len(anchor)
    with pytest.raises(ValueError):
        chunk_view(entry, len(anchor), 3)  # encoded for seam len(anchor) + 2
    with pytest.raises(ValueError):
        chunk_view(entry, len(ids), 2 - len(chunk))


@pytest.mark.parametrize("seam", [0, SEAM])
def test_a_chunk_right_after_the_prefix_composes_exactly_from_its_anchored_entry(engine: Engine, seam: int) -> None:
    """Its anchored entry was encoded after the very tokens that precede it: `full`, to float32 round-off."""
    request = random_request(1, [17])
    full = engine.prefill(request, "full")
    anchored = engine.prefill(request, "hypic", policy=f"seam@{seam}+anchored")
    torch.testing.assert_close(anchored.logits, full.logits, atol=1e-5, rtol=1e-5)
    assert anchored.stats.recomputed_tokens == seam + len(request.question_ids)
    plain = engine.prefill(request, "hypic", policy=f"seam@{seam}")
    assert (plain.logits - full.logits).abs().max() > 1e-3  # standalone: not exact (the test can fail)


def test_anchored_with_the_other_chunks_whole_equals_full(engine: Engine) -> None:
    request = random_request(2, [11, 14, 9])
    request.chunk_ranks = [2, 0, 1]  # the first chunk (right after the prefix) is the one read from its entry
    result = engine.prefill(request, "hypic", policy="whole:2@0+anchored")
    torch.testing.assert_close(result.logits, engine.prefill(request, "full").logits, atol=1e-5, rtol=1e-5)


def test_anchored_entries_are_kept_under_their_own_key(engine: Engine) -> None:
    fresh = Engine(engine.model, seam_tokens=SEAM)
    request = random_request(3, [10, 13, 8])
    keys = fresh.segment_entry_keys(request, "hypic", policy="seam+anchored")
    anchor = anchor_of(request.prefix_ids)
    assert keys[0] == (0, tuple(request.prefix_ids))  # the prefix sits at position 0: its own seam-0 entry
    assert keys[1:] == [anchored_key(anchor, chunk, SEAM) for chunk in request.chunk_ids]
    first = fresh.prefill(request, "hypic", policy="seam+anchored")
    assert first.stats.cache_misses == 4 and first.stats.encoded_tokens == sum(
        len(chunk) - SEAM for chunk in request.chunk_ids) + len(request.prefix_ids)
    assert fresh.entries.missing([list(ids) for _, ids in keys[1:]], len(anchor) + SEAM) == []
    assert fresh.entries.missing(request.chunk_ids, SEAM) == request.chunk_ids  # no plain entry made
    again = fresh.prefill(request, "hypic", policy="seam+anchored")
    assert again.stats.cache_hits == 4 and again.stats.encoded_tokens == 0
    torch.testing.assert_close(again.logits, first.logits, atol=0, rtol=0)
    # whole chunks read nothing; plain policies and other modes read plain entries
    assert fresh.segment_entry_keys(request, "hypic", policy="whole:3+anchored")[1:] == [None, None, None]
    assert fresh.segment_entry_keys(request, "hypic", policy="seam")[1:] == [(SEAM, tuple(c)) for c in request.chunk_ids]
    assert fresh.segment_entry_keys(request, "transition_rope", policy="seam+anchored")[1:] == [
        (0, tuple(c)) for c in request.chunk_ids]


def test_without_a_prefix_anchored_entries_are_the_plain_ones(engine: Engine) -> None:
    request = random_request(4, [10, 12], prefix=0)
    keys = engine.segment_entry_keys(request, "hypic", policy="seam+anchored")
    assert keys == [(SEAM, tuple(chunk)) for chunk in request.chunk_ids]
    torch.testing.assert_close(engine.prefill(request, "hypic", policy="seam+anchored").logits,
                               engine.prefill(request, "hypic", policy="seam").logits, atol=0, rtol=0)


def test_precompute_plans_the_anchored_entries_ask_reads(tiny_model) -> None:
    from hypic_rag.runtime.model import load_model
    from hypic_rag.pipeline.session import ModelSession

    with ModelSession.of_model(load_model(tiny_model, device="cpu"), seam_tokens=SEAM,
                               recompute_policy="seam@0+anchored") as session:
        prefix = session.prefix_ids
        chunks = [random_request(5, [9]).chunk_ids[0], random_request(6, [12]).chunk_ids[0]]
        plans = session.plan(chunks)
        anchor = anchor_of(prefix)
        assert [(plan.seam_tokens, plan.segments) for plan in plans] == [
            (0, [prefix]), (len(anchor), [list(anchored_key(anchor, chunk, 0)[1]) for chunk in chunks])]
        session.fill_cache(plans)
        result = session.engine.prefill(Request(prefix, chunks, [5, 6, 7]), "hypic")
        assert result.stats.cache_misses == 0 and result.stats.encoded_tokens == 0
        assert result.stats.recomputed_tokens == 3  # seam 0: the question alone
