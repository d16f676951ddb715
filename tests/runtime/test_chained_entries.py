"""Chained entries (`runtime/anchoring.chained_anchor`, the `+chained` recompute policies): a chunk that follows its
document's previous chunk in the prompt reads the entry encoded after the anchor and that chunk. Exact where it
claims to be (the first two chunks after the prefix, one following the other, compose to `full`), with the same
request from anchored entries as the check that can fail; the keys the engine and precompute use; tiny random model."""

from __future__ import annotations

import functools

import pytest
import torch

from hypic_rag.runtime.anchoring import anchor_of, anchored_key, chained_anchor
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.recompute_policy import RecomputePolicy
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request as shared_random_request

SEAM = 4
random_request = functools.partial(shared_random_request, prefix=6, question=5)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=SEAM)


@pytest.mark.parametrize("spec", ["seam@0+chained", "seam+chained", "budget:2@8+chained", "whole:1+chained"])
def test_a_chained_spec_round_trips_and_is_anchored(spec: str) -> None:
    policy = RecomputePolicy.parse(spec)
    assert policy.chained and policy.anchored and policy.spec == spec
    assert RecomputePolicy.from_dict(policy.to_dict()) == policy
    assert policy.resolved(SEAM).chained
    assert not RecomputePolicy.parse("seam+anchored").chained


def test_a_request_says_which_chunks_follow_their_antecedent() -> None:
    with pytest.raises(ValueError, match="2 chunk_follows flags for 3 chunks"):
        Request([1], [[2], [3], [4]], [5], chunk_follows=[False, True])
    with pytest.raises(ValueError, match="first chunk follows no chunk"):
        Request([1], [[2], [3]], [5], chunk_follows=[True, False])


@pytest.mark.parametrize("seam", [0, SEAM])
def test_two_chunks_of_one_document_after_the_prefix_compose_exactly(engine: Engine, seam: int) -> None:
    """The second chunk's chained entry was encoded after the very tokens that precede it: `full`, to round-off;
    the same request reading its anchored entry (encoded after the prefix alone) is not (the check can fail)."""
    request = random_request(1, [13, 17])
    request.chunk_follows = [False, True]
    full = engine.prefill(request, "full")
    chained = engine.prefill(request, "hypic", policy=f"seam@{seam}+chained")
    torch.testing.assert_close(chained.logits, full.logits, atol=1e-5, rtol=1e-5)
    assert chained.stats.recomputed_tokens == 2 * seam + len(request.question_ids)
    anchored = engine.prefill(request, "hypic", policy=f"seam@{seam}+anchored")
    assert (anchored.logits - full.logits).abs().max() > 1e-3
    request.chunk_follows = []  # not marked as one document: the anchored entry is read, not exact either
    unmarked = engine.prefill(request, "hypic", policy=f"seam@{seam}+chained")
    torch.testing.assert_close(unmarked.logits, anchored.logits, atol=0, rtol=0)


def test_chained_with_the_other_chunks_whole_equals_full(engine: Engine) -> None:
    request = random_request(2, [11, 14, 9, 12])
    request.chunk_follows = [False, True, False, True]
    request.chunk_ranks = [3, 2, 0, 1]  # the two later chunks recomputed whole
    result = engine.prefill(request, "hypic", policy="whole:2@0+chained")
    torch.testing.assert_close(result.logits, engine.prefill(request, "full").logits, atol=1e-5, rtol=1e-5)


def test_chained_entries_are_kept_under_their_own_key(engine: Engine) -> None:
    fresh = Engine(engine.model, seam_tokens=SEAM)
    request = random_request(3, [10, 13, 8])
    request.chunk_follows = [False, True, False]
    keys = fresh.segment_entry_keys(request, "hypic", policy="seam+chained")
    anchor = anchor_of(request.prefix_ids)
    chunks = request.chunk_ids
    assert keys[1:] == [anchored_key(anchor, chunks[0], SEAM),
                        anchored_key(chained_anchor(anchor, chunks[0]), chunks[1], SEAM),
                        anchored_key(anchor, chunks[2], SEAM)]
    assert fresh.segment_entry_keys(request, "hypic", policy="seam+anchored")[1:] == [
        anchored_key(anchor, chunk, SEAM) for chunk in chunks]


def test_precompute_plans_the_chained_entries_ask_reads(tiny_model) -> None:
    from hypic_rag.runtime.model import load_model
    from hypic_rag.pipeline.session import ModelSession

    with ModelSession.of_model(load_model(tiny_model, device="cpu"), seam_tokens=SEAM,
                               recompute_policy="seam@0+chained") as session:
        prefix = session.prefix_ids
        first, second = random_request(5, [9]).chunk_ids[0], random_request(6, [12]).chunk_ids[0]
        plans = session.plan([first, second], successors=[(first, second)])
        anchor = anchor_of(prefix)
        chained_seam, chained_ids = anchored_key(chained_anchor(anchor, first), second, 0)
        assert (chained_seam, [list(chained_ids)]) in [(plan.seam_tokens, plan.segments) for plan in plans]
        session.fill_cache(plans)
        result = session.engine.prefill(Request(prefix, [first, second], [5, 6, 7], chunk_follows=[False, True]),
                                        "hypic")
        assert result.stats.cache_misses == 0 and result.stats.encoded_tokens == 0
        assert result.stats.recomputed_tokens == 3


def test_calibration_offers_chained_policies_and_prefers_anchored_on_a_tie(engine: Engine) -> None:
    """Where no chunk follows its document's previous one, a chained policy reads the anchored entries: the same
    scores, and the anchored one is chosen (nothing extra to precompute)."""
    from hypic_rag.calibration.policy import calibrate
    from hypic_rag.runtime.recompute_policy import calibration_candidates

    specs = [policy.spec for policy in calibration_candidates()]
    assert specs.index("seam@0+anchored") < specs.index("seam@0+chained")
    requests = [random_request(seed, [9, 11, 10]) for seed in (7, 8)]
    tied = calibrate(engine, requests, ["seam@0+chained", "seam@0+anchored"], kl_target=10.0)
    assert tied.chosen.spec == "seam@0+anchored"
    scores = {score.spec: score.mean_kl for score in tied.candidates}
    assert scores["seam@0+chained"] == scores["seam@0+anchored"]
    for request in requests:
        request.chunk_follows = [False, True, True]
    followed = calibrate(engine, requests, ["seam@0+anchored", "seam@0+chained"], kl_target=0.0)
    scores = {score.spec: score.mean_kl for score in followed.candidates}
    assert scores["seam@0+chained"] < scores["seam@0+anchored"]  # the chained entries saw their antecedents
