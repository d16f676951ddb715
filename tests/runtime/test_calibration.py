"""Calibration picks the cheapest recompute policy meeting a KL target (tiny random model), and the choice
round-trips through an index manifest into the session `ask` and `serve` open."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hypic_rag.calibration.policy import (
    CandidateScore,
    Calibration,
    calibrate,
    choose,
    score_candidates,
    seam_plan_tokens,
)
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.recompute_policy import SEAM_POLICY, RecomputePolicy, RecomputePolicyError
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model

CANDIDATES = ("seam", "whole:1", "whole:2", "whole:3")


@pytest.fixture(scope="module")
def engine_and_requests() -> tuple[Engine, list[Request]]:
    generator = torch.Generator().manual_seed(7)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=11)), seam_tokens=2)
    requests = [Request(ids(4), [ids(12), ids(16), ids(10)], ids(5), chunk_ranks=[1, 0, 2]) for _ in range(3)]
    return engine, requests


def test_scores_are_each_candidates_mean_kl_and_tokens(engine_and_requests) -> None:
    engine, requests = engine_and_requests
    scores = {score.spec: score for score in score_candidates(engine, requests, CANDIDATES)}
    for spec in CANDIDATES:  # recomputed independently
        kls = [kl_divergence(engine.prefill(r, "full").logits, engine.prefill(r, "hypic", policy=spec).logits)
               for r in requests]
        tokens = [engine.prefill(r, "hypic", policy=spec).stats.recomputed_tokens for r in requests]
        assert scores[spec].mean_kl == pytest.approx(sum(kls) / len(kls), abs=1e-9)
        assert scores[spec].max_kl == pytest.approx(max(kls), abs=1e-9)
        assert scores[spec].recomputed_tokens == sum(tokens) / len(tokens)
        assert scores[spec].requests == len(requests)
    assert scores["whole:3"].mean_kl < 1e-8  # every chunk whole is `full`
    assert scores["seam"].mean_kl > 1e-4


def test_calibration_picks_the_cheapest_policy_meeting_the_target(engine_and_requests) -> None:
    engine, requests = engine_and_requests
    scores = score_candidates(engine, requests, CANDIDATES)
    by_cost = sorted(scores, key=lambda s: s.recomputed_tokens)
    assert [s.spec for s in by_cost] == list(CANDIDATES)  # on these requests, cost grows along the list
    for target in sorted({s.mean_kl for s in scores}) + [1e3]:
        expected = next(s.spec for s in by_cost if s.mean_kl <= target)
        result = calibrate(engine, requests, CANDIDATES, target, measured=scores)
        assert (result.chosen.spec, result.met) == (expected, True)
    # a target between two candidates' KLs: the cheaper one above it is skipped
    seam_kl = next(s.mean_kl for s in scores if s.spec == "seam")
    assert calibrate(engine, requests, CANDIDATES, seam_kl * 0.999, measured=scores).chosen.spec != "seam"
    # the whole run (scoring included) agrees with the measured shortcut
    assert calibrate(engine, requests, CANDIDATES, seam_kl).chosen.spec == "seam"


def test_an_unmet_target_gives_the_closest_candidate_marked_unmet(engine_and_requests) -> None:
    engine, requests = engine_and_requests
    result = calibrate(engine, requests, ("seam", "whole:1"), 0.0)
    assert not result.met
    assert result.chosen.spec == min(result.candidates, key=lambda c: c.mean_kl).spec


def test_a_cap_on_recomputed_tokens_leaves_the_dearer_candidates_out(engine_and_requests) -> None:
    """`max_recompute` X: the choice is among the candidates recomputing at most X times the fixed seam's tokens on
    the same requests (`seam_plan_tokens`: what the seam candidate recomputes); the dearer ones are still listed."""
    engine, requests = engine_and_requests
    scores = score_candidates(engine, requests, CANDIDATES)
    by_spec = {score.spec: score for score in scores}
    assert seam_plan_tokens(engine, requests) == by_spec["seam"].recomputed_tokens
    uncapped = calibrate(engine, requests, CANDIDATES, 0.0, measured=scores)
    assert uncapped.chosen.spec == "whole:3" and uncapped.token_cap is None  # every chunk whole: the lowest KL
    factor = by_spec["whole:2"].recomputed_tokens / by_spec["seam"].recomputed_tokens
    capped = calibrate(engine, requests, CANDIDATES, 0.0, measured=scores, max_recompute=factor)
    within = [score for score in scores if score.recomputed_tokens <= by_spec["whole:2"].recomputed_tokens]
    assert capped.chosen.spec == min(within, key=lambda score: score.mean_kl).spec != "whole:3"  # lowest KL within
    assert not capped.met
    assert capped.token_cap == pytest.approx(by_spec["whole:2"].recomputed_tokens)
    assert len(capped.candidates) == len(CANDIDATES)
    assert Calibration.from_dict(json.loads(json.dumps(capped.to_dict()))) == capped
    assert calibrate(engine, requests, CANDIDATES, 1e3, measured=scores, max_recompute=1.0).chosen.spec == "seam"
    with pytest.raises(RecomputePolicyError, match="no candidate recomputes at most"):
        calibrate(engine, requests, ("whole:2", "whole:3"), 1e3, measured=scores[2:], max_recompute=1.0)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(RecomputePolicyError, match="max_recompute"):
            calibrate(engine, requests, CANDIDATES, 0.1, measured=scores, max_recompute=bad)


def test_calibration_checks_its_inputs(engine_and_requests) -> None:
    engine, requests = engine_and_requests
    for target in (-1.0, float("nan"), float("inf")):
        with pytest.raises(RecomputePolicyError):
            calibrate(engine, requests, CANDIDATES, target)
    with pytest.raises(RecomputePolicyError):
        score_candidates(engine, [], CANDIDATES)
    with pytest.raises(RecomputePolicyError):
        score_candidates(engine, requests, ["whole:x"])
    with pytest.raises(RecomputePolicyError):
        choose([], 0.1)


def test_a_calibration_round_trips_through_a_dict() -> None:
    scores = (CandidateScore("seam", 0.5, 1.5, 0.8, 20.0, 4), CandidateScore("whole:1", 0.01, 0.03, 1.0, 31.5, 4))
    calibration = choose(scores, 0.05)
    assert calibration.chosen == RecomputePolicy.parse("whole:1") and calibration.met
    assert Calibration.from_dict(json.loads(json.dumps(calibration.to_dict()))) == calibration


def test_the_choice_round_trips_through_the_manifest_into_ask_and_serve_sessions(tmp_path: Path, copy_tiny_index) -> None:
    from hypic_rag.calibration.index import calibrate_index, probe_questions
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.retrieval.corpus_index import record_recompute_policy
    from hypic_rag.retrieval.errors import IndexCorruptError
    from hypic_rag.retrieval.manifest import IndexManifest

    index = copy_tiny_index(tmp_path / "index")
    pipeline = RagPipeline.open(index, device="cpu")
    try:
        assert pipeline.session.recompute_policy == SEAM_POLICY  # nothing recorded: the fixed seam
        assert len(probe_questions(pipeline.index, 3)) == 3
        result, record = calibrate_index(pipeline, kl_target=0.0, requests=3, top_k=3,
                                         candidates=("seam", "whole:1", "whole:3"))
    finally:
        pipeline.close()
    # whole:3 of the 3 retrieved chunks is `full`: the lowest KL (round-off), chosen whether target 0 is met or not
    assert result.chosen.spec == "whole:3" and result.score.mean_kl < 1e-8
    assert record["policy"] == "whole:3" and record["top_k"] == 3
    record_recompute_policy(index, {**record, "policy": "whole:1"})
    manifest = IndexManifest.load(index)
    assert manifest.recompute_policy_spec == "whole:1"
    assert manifest.recompute_policy["requests"] == 3 and manifest.recompute_policy["source"] == "index probes"
    reopened = RagPipeline.open(index, device="cpu")
    try:
        assert reopened.session.recompute_policy == RecomputePolicy.parse("whole:1")
        answer = reopened.answer("Where does the river flow?", top_k=3)
        assert answer.recompute_policy == "whole:1@8"
        assert reopened.answer("Where does the river flow?", top_k=3, mode="full").recompute_policy == ""
        overridden = reopened.answer("Where does the river flow?", top_k=3, policy="seam")
        assert overridden.recompute_policy == "seam@8"
        assert overridden.usage["recomputed_tokens"] < answer.usage["recomputed_tokens"]
    finally:
        reopened.close()
    other = RagPipeline.open(index, device="cpu", recompute_policy="budget:2")
    try:
        assert other.session.recompute_policy == RecomputePolicy.parse("budget:2")
    finally:
        other.close()
    assert record_recompute_policy(index, None).recompute_policy_spec is None  # cleared: the fixed seam again
    assert IndexManifest.load(index).recompute_policy is None
    # a damaged record is an unreadable manifest, not a silent fallback
    data = json.loads((index / "manifest.json").read_text())
    data["recompute_policy"] = {"policy": "whole:0"}
    (index / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(IndexCorruptError):
        IndexManifest.load(index)
