"""Per-model calibration: the cheapest recompute policy that meets a KL target on a few requests.

For each request the reference is `full`'s next-token distribution after the prompt; each candidate policy
(`recompute_policy.py`) assembles the same request under `hypic` and is scored by the mean over the requests of
KL(full || candidate) of that distribution, and by the tokens it recomputes per request. The choice is the
candidate of fewest recomputed tokens whose mean KL is at most the target (ties: the lower KL); when none meets
it, the candidate of lowest KL, marked `met = False`. A cap on the cost (`max_recompute`: at most X times the tokens
the fixed seam recomputes on the same requests, `seam_plan_tokens`) leaves the candidates above it out of the
choice (they are still scored and listed). An index records the choice in its manifest
(`hypic-rag calibrate`), and `ask` and `serve` use it unless told another policy.

The calibration requests must not be the requests the choice is then judged on (the evaluation in
`evals/recompute_policies.py` calibrates on other worlds than its held-out set).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.recompute_policy import (
    DEFAULT_KL_TARGET,
    SEAM_POLICY,
    RecomputePolicy,
    RecomputePolicyError,
    as_policy,
    calibration_candidates,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate over the calibration requests: mean and largest KL(full || candidate) of the next-token
    distribution, share of requests whose most likely next token is `full`'s, mean recomputed tokens."""

    spec: str
    mean_kl: float
    max_kl: float
    top1_agreement: float
    recomputed_tokens: float
    requests: int

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CandidateScore:
        return cls(str(data["spec"]), float(data["mean_kl"]), float(data["max_kl"]), float(data["top1_agreement"]),
                   float(data["recomputed_tokens"]), int(data["requests"]))


@dataclass(frozen=True, slots=True)
class Calibration:
    """The chosen policy, the target, whether it was met, every candidate's scores (cheapest first), and the cap on
    recomputed tokens per request the choice was held to (`max_recompute` times the fixed seam's `seam_tokens`
    tokens per request: `token_cap`; None: no cap)."""

    chosen: RecomputePolicy
    kl_target: float
    met: bool
    candidates: tuple[CandidateScore, ...] = field(default_factory=tuple)
    max_recompute: float | None = None
    token_cap: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.kl_target, (int, float)) and math.isfinite(self.kl_target) and self.kl_target >= 0):
            raise RecomputePolicyError(f"the KL target must be a number >= 0, got {self.kl_target!r}")

    @property
    def score(self) -> CandidateScore | None:
        """The chosen candidate's scores."""
        return next((c for c in self.candidates if c.spec == self.chosen.spec), None)

    def to_dict(self) -> dict[str, Any]:
        capped = {} if self.token_cap is None else {"max_recompute": self.max_recompute, "token_cap": self.token_cap}
        return {"policy": self.chosen.spec, "kl_target": self.kl_target, "met": self.met, **capped,
                "candidates": [candidate.to_dict() for candidate in self.candidates]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        if not isinstance(data, dict):
            raise RecomputePolicyError(f"a recorded calibration must be an object, got {type(data).__name__}")
        cap, factor = data.get("token_cap"), data.get("max_recompute")
        return cls(RecomputePolicy.parse(data["policy"]), float(data["kl_target"]), bool(data["met"]),
                   tuple(CandidateScore.from_dict(item) for item in data.get("candidates", ())),
                   None if factor is None else float(factor), None if cap is None else float(cap))


def score_candidates(
    engine: Any, requests: Sequence[Any], candidates: Sequence[RecomputePolicy | str], *,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[CandidateScore]:
    """Every candidate's scores over `requests` (each a `Request`, ranked as the product ranks its chunks); one
    `full` prefill and one `hypic` prefill per candidate per request. `on_progress(done, total)` after each
    request."""
    if not requests:
        raise RecomputePolicyError("calibration needs at least one request")
    policies = [as_policy(candidate) for candidate in candidates]
    if not policies:
        raise RecomputePolicyError("calibration needs at least one candidate policy")
    kls: list[list[float]] = [[] for _ in policies]
    agree: list[int] = [0] * len(policies)
    tokens: list[int] = [0] * len(policies)
    for done, request in enumerate(requests, start=1):
        reference = engine.prefill(request, "full").logits
        best = int(reference.argmax())
        for number, policy in enumerate(policies):
            result = engine.prefill(request, "hypic", policy=policy)
            kls[number].append(kl_divergence(reference, result.logits))
            agree[number] += int(result.logits.argmax()) == best
            tokens[number] += result.stats.recomputed_tokens
        if on_progress is not None:
            on_progress(done, len(requests))
    count = len(requests)
    return [
        CandidateScore(policy.spec, sum(values) / count, max(values), agree[number] / count, tokens[number] / count,
                       count)
        for number, (policy, values) in enumerate(zip(policies, kls))
    ]


def seam_plan_tokens(engine: Any, requests: Sequence[Any]) -> float:
    """Mean tokens per request the fixed seam (`SEAM_POLICY` at `engine`'s seam) recomputes over `requests`: each
    chunk's seam window and the question, as `hypic`'s statistics count them, from the plans alone (no prefill)."""
    if not requests:
        raise RecomputePolicyError("calibration needs at least one request")
    total = 0
    for request in requests:
        lengths = [len(chunk) for chunk in request.chunk_ids]
        total += SEAM_POLICY.plan(lengths, engine.seam_tokens).recomputed_chunk_tokens(lengths)
        total += len(request.question_ids)
    return total / len(requests)


def choose(scores: Sequence[CandidateScore], kl_target: float, *, token_cap: float | None = None,
           max_recompute: float | None = None) -> Calibration:
    """The cheapest candidate (fewest recomputed tokens, then lower KL, then one that needs no chained entries)
    with mean KL <= `kl_target`; else the one of lowest KL, not met. With `token_cap`, only the candidates
    recomputing at most that many tokens per request are chosen from (`max_recompute`: the factor it came from, for
    the record); `RecomputePolicyError` when none does."""
    if not scores:
        raise RecomputePolicyError("no candidates to choose from")
    ordered = tuple(sorted(scores, key=lambda c: (c.recomputed_tokens, c.mean_kl,
                                                  RecomputePolicy.parse(c.spec).chained)))
    allowed = [c for c in ordered if token_cap is None or c.recomputed_tokens <= token_cap + 1e-9]
    if not allowed:
        raise RecomputePolicyError(f"no candidate recomputes at most {token_cap:.1f} tokens per request (the cap); "
                                   f"the cheapest, {ordered[0].spec}, recomputes {ordered[0].recomputed_tokens:.1f}")
    capped = {"max_recompute": max_recompute, "token_cap": token_cap}
    meeting = [candidate for candidate in allowed if candidate.mean_kl <= kl_target]
    if meeting:
        return Calibration(RecomputePolicy.parse(meeting[0].spec), kl_target, True, ordered, **capped)
    closest = min(allowed, key=lambda c: (c.mean_kl, c.recomputed_tokens))
    return Calibration(RecomputePolicy.parse(closest.spec), kl_target, False, ordered, **capped)


def calibrate(
    engine: Any, requests: Sequence[Any], candidates: Sequence[RecomputePolicy | str] | None = None,
    kl_target: float = DEFAULT_KL_TARGET, *, measured: Sequence[CandidateScore] | None = None,
    max_recompute: float | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> Calibration:
    """Score `candidates` (None: every registered policy's, `recompute_policy.calibration_candidates`) on
    `requests` (or reuse `measured` scores) and choose for `kl_target` (`choose`), among the candidates that
    recompute at most `max_recompute` times the fixed seam's tokens per request on `requests` (None: all)."""
    Calibration(SEAM_POLICY, kl_target, True)  # checks the target before any work
    if max_recompute is not None and not (isinstance(max_recompute, (int, float)) and math.isfinite(max_recompute)
                                          and max_recompute > 0):
        raise RecomputePolicyError(f"max_recompute must be a number > 0, got {max_recompute!r}")
    token_cap = None if max_recompute is None else max_recompute * seam_plan_tokens(engine, requests)
    if candidates is None:
        candidates = calibration_candidates()
    scores = list(measured) if measured is not None else score_candidates(engine, requests, candidates,
                                                                          on_progress=on_progress)
    result = choose(scores, kl_target, token_cap=token_cap, max_recompute=max_recompute)
    logger.info("calibration: %s (mean KL %.4g, target %.4g, %s)", result.chosen.spec,
                result.score.mean_kl if result.score else float("nan"), kl_target, "met" if result.met else "not met")
    return result
