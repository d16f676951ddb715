"""Recompute policies: their specs, their span plans (budget respected, the chosen chunks whole, seam for the rest)
and the engine's prefill under them against hand-built span plans and `full`, on a tiny random model."""

from __future__ import annotations

import random

import pytest
import torch

from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.recompute_policy import (
    WHOLE,
    BudgetPolicy,
    RecomputePlan,
    RecomputePolicy,
    RecomputePolicyError,
    SeamPolicy,
    TokensPolicy,
    WholePolicy,
    as_policy,
)
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import Span, run_stack
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request

SEAM = 4




@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=SEAM)


# ------------------------------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("spec", ["seam", "seam@16", "whole:1", "whole:3@8", "budget:2", "budget:1.5@0", "tokens:96@0",
                                  "tokens:40"])
def test_a_spec_round_trips(spec: str) -> None:
    policy = RecomputePolicy.parse(spec)
    assert policy.spec == spec
    assert RecomputePolicy.from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize("spec", ["", "seams", "whole", "whole:0", "whole:1.5", "budget", "budget:0.5", "seam:3",
                                  "whole:2@", "whole:-1", "budget:2@x", " whole : 1", "tokens", "tokens:0",
                                  "tokens:1.5"])
def test_a_bad_spec_is_a_one_line_error_naming_the_forms(spec: str) -> None:
    with pytest.raises(RecomputePolicyError) as raised:
        RecomputePolicy.parse(spec)
    message = str(raised.value)
    assert "\n" not in message and "policy" in message
    assert isinstance(raised.value, ValueError) and raised.value.exit_code == 2


def test_as_policy_accepts_specs_policies_and_none() -> None:
    assert as_policy(None) is None
    assert as_policy("whole:2") == WholePolicy(chunks=2)
    policy = BudgetPolicy(budget=3)
    assert as_policy(policy) is policy
    with pytest.raises(RecomputePolicyError):
        as_policy(3)


# ------------------------------------------------------------------------------------------------------- plans
def test_seam_plan_gives_every_chunk_the_seam() -> None:
    assert SeamPolicy().plan([10, 3, 7], SEAM).chunk_seams == (SEAM, SEAM, SEAM)
    assert RecomputePolicy.parse("seam@9").plan([10, 3], SEAM).chunk_seams == (9, 9)


def test_whole_plan_recomputes_the_top_ranked_chunks_and_seams_the_rest() -> None:
    lengths = [12, 9, 15, 7, 11]
    ranks = [3, 0, 4, 1, 2]
    plan = RecomputePolicy.parse("whole:2").plan(lengths, SEAM, ranks)
    assert plan.whole_chunks == [1, 3]
    assert plan.chunk_seams == (SEAM, WHOLE, SEAM, WHOLE, SEAM)
    assert plan.recomputed_chunk_tokens(lengths) == 9 + 7 + 3 * SEAM
    # no ranks: prompt order; more chunks asked than held: all of them
    assert RecomputePolicy.parse("whole:2@6").plan(lengths, SEAM).chunk_seams == (WHOLE, WHOLE, 6, 6, 6)
    assert RecomputePolicy.parse("whole:9").plan(lengths, SEAM).whole_chunks == [0, 1, 2, 3, 4]


def test_budget_plan_never_exceeds_its_budget_and_spends_it_in_rank_order() -> None:
    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 10)
        lengths = [rng.randint(1, 60) for _ in range(count)]
        ranks = rng.sample(range(count), count)
        budget = rng.choice([1.0, 1.5, 2.0, 3.0, 10.0])
        seam = rng.choice([0, 2, 4, 8])
        plan = BudgetPolicy(budget=budget).plan(lengths, seam, ranks)
        seam_tokens = sum(min(seam, length) for length in lengths)
        assert plan.recomputed_chunk_tokens(lengths) <= budget * seam_tokens + 1e-9
        assert all(s in (seam, WHOLE) for s in plan.chunk_seams)
        # greedy in rank order: every chunk left at its seam would have overflowed the budget when it was tried
        spent = seam_tokens
        for number in sorted(range(count), key=lambda n: ranks[n]):
            extra = lengths[number] - min(seam, lengths[number])
            if plan.chunk_seams[number] is WHOLE:
                spent += extra
            else:
                assert extra == 0 or spent + extra > budget * seam_tokens


def test_token_budget_plan_never_exceeds_its_tokens_unless_the_seams_alone_do() -> None:
    rng = random.Random(1)
    for _ in range(300):
        count = rng.randint(1, 10)
        lengths = [rng.randint(1, 60) for _ in range(count)]
        ranks = rng.sample(range(count), count)
        seam, limit = rng.choice([0, 4, 8]), rng.randint(1, 300)
        plan = TokensPolicy(tokens=limit, seam_tokens=seam).plan(lengths, SEAM, ranks)
        seams_only = sum(min(seam, length) for length in lengths)
        assert plan.recomputed_chunk_tokens(lengths) <= max(limit, seams_only)
        left = [n for n in range(count) if plan.chunk_seams[n] is not WHOLE and lengths[n] > seam]
        used = plan.recomputed_chunk_tokens(lengths)
        assert all(used + lengths[n] - min(seam, lengths[n]) > limit for n in left)  # nothing more would fit
    plan = RecomputePolicy.parse("tokens:80@0").plan([34, 30, 33, 35], SEAM, [2, 0, 1, 3])
    assert plan.chunk_seams == (0, WHOLE, WHOLE, 0)


def test_plan_checks_its_ranks() -> None:
    with pytest.raises(ValueError):
        RecomputePolicy.parse("whole:1").plan([3, 4], SEAM, [0])
    with pytest.raises(ValueError):
        Request([1], [[2], [3]], [4], chunk_ranks=[0])


# ------------------------------------------------------------------------------------------------------- engine
def hand_built(engine: Engine, request: Request, plan: RecomputePlan) -> torch.Tensor:
    """The logits of `plan` built span by span here (entries fetched at each chunk's seam), not by the engine."""
    stats = PrefillStats(mode="hypic")
    spans, position = [], 0
    if request.prefix_ids:
        spans.append(Span(request.prefix_ids, 0, 0, engine.fetch_entries([request.prefix_ids], 0, stats)[0]))
        position = len(request.prefix_ids)
    for chunk, seam in zip(request.chunk_ids, plan.chunk_seams):
        if seam is WHOLE:
            spans.append(Span(chunk, position, len(chunk)))
        else:
            entry = engine.fetch_entries([chunk], seam, stats)[0]
            spans.append(Span(chunk, position, min(seam, len(chunk)), entry))
        position += len(chunk)
    spans.append(Span(request.question_ids, position, len(request.question_ids)))
    return run_stack(engine.model, spans).logits


@pytest.mark.parametrize("spec", ["whole:1", "whole:2@2", "budget:2", "seam@6", "tokens:30@0"])
def test_prefill_under_a_policy_is_its_span_plan(engine: Engine, spec: str) -> None:
    request = random_request(1, [14, 9, 20, 11])
    request.chunk_ranks = [2, 3, 0, 1]
    plan = engine.plan(request, policy=spec)
    result = engine.prefill(request, "hypic", policy=spec)
    torch.testing.assert_close(result.logits, hand_built(engine, request, plan), atol=1e-5, rtol=1e-5)
    lengths = [len(chunk) for chunk in request.chunk_ids]
    assert result.stats.recomputed_tokens == plan.recomputed_chunk_tokens(lengths) + len(request.question_ids)
    if spec.startswith("whole:1"):
        assert plan.whole_chunks == [2]  # rank 0


def test_chunks_recomputed_whole_read_no_entry() -> None:
    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=SEAM)
    request = random_request(2, [10, 12, 8], prefix=0)
    request.chunk_ranks = [1, 0, 2]
    engine.prefill(request, "hypic", policy="whole:1")
    assert engine.entries.missing(request.chunk_ids, SEAM) == [request.chunk_ids[1]]


@pytest.mark.parametrize("prefix", [5, 0])
def test_every_chunk_recomputed_whole_equals_full(engine: Engine, prefix: int) -> None:
    request = random_request(3, [13, 17, 6, 21], prefix=prefix)
    full = engine.prefill(request, "full")
    for spec in ("whole:4", "budget:1000"):
        result = engine.prefill(request, "hypic", policy=spec)
        torch.testing.assert_close(result.logits, full.logits, atol=1e-5, rtol=1e-5)
        assert result.stats.recomputed_tokens == request.prompt_tokens - prefix


def test_the_default_policy_is_the_engines_seam(engine: Engine) -> None:
    request = random_request(4, [12, 9, 15])
    default = engine.prefill(request, "hypic").logits
    torch.testing.assert_close(engine.prefill(request, "hypic", policy="seam").logits, default, atol=0, rtol=0)
    torch.testing.assert_close(engine.prefill(request, "hypic", policy=f"seam@{SEAM}").logits, default, atol=0, rtol=0)
    # other modes ignore the policy
    torch.testing.assert_close(engine.prefill(request, "transition_rope", policy="whole:3").logits,
                               engine.prefill(request, "transition_rope").logits, atol=0, rtol=0)
    with_policy = Engine(engine.model, seam_tokens=SEAM, recompute_policy="whole:3")
    torch.testing.assert_close(with_policy.prefill(request, "hypic").logits, engine.prefill(request, "full").logits,
                               atol=1e-5, rtol=1e-5)


def test_generation_follows_the_policy(engine: Engine) -> None:
    from hypic_rag.runtime.sampling import SamplingParams

    request = random_request(5, [12, 9, 15])
    params = SamplingParams(max_new_tokens=6)
    whole = engine.generate(request, "hypic", params, policy="whole:3")
    full = engine.generate(request, "full", params)
    assert whole.token_ids == full.token_ids
    assert whole.prefill.recomputed_tokens == request.prompt_tokens - len(request.prefix_ids)


def test_retrieval_ranks_alternate_direct_and_hop_hits() -> None:
    from hypic_rag.pipeline.answering import retrieval_ranks

    # prompt order: 4 direct hits, then 2 hop hits -> d0, h0, d1, h1, d2, d3
    assert retrieval_ranks([False, False, False, False, True, True]) == [0, 2, 4, 5, 1, 3]
    assert retrieval_ranks([False, False]) == [0, 1]
    assert retrieval_ranks([]) == []
    ranks = retrieval_ranks([False, True, False])
    assert RecomputePolicy.parse("whole:2").plan([10, 10, 10], SEAM, ranks).whole_chunks == [0, 1]
