"""A new recompute policy is one class plus `@register_policy`: the toy policy of docs/recompute_policies.md
("Adding a policy", its block run here) parses, prints, plans, runs in the engine, shows in the help texts and error
messages, and joins calibration's candidates, with nothing else changed. The registry refuses a kind twice, and an unregistered class."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.recompute_policy import (
    POLICIES,
    WHOLE,
    RecomputePlan,
    RecomputePolicy,
    RecomputePolicyError,
    calibration_candidates,
    policy_help,
    register_policy,
    spec_help,
)
from hypic_rag.testing import build_tiny_model
from kits.corpora import random_request

SEAM = 4


DOC = Path(__file__).resolve().parents[2] / "docs" / "recompute_policies.md"
HEADING = "### Adding a policy"


def doc_block() -> str:
    """The one ```python block of docs/recompute_policies.md, under "Adding a policy": it defines and registers
    `LongestPolicy`."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index(HEADING):]
    blocks = re.findall(r"^```python\n(.*?)^```$", section[: section.index("\n## ")], flags=re.S | re.M)
    assert len(blocks) == 1, f"expected one ```python block under {HEADING!r}"
    return blocks[0]


@pytest.fixture
def longest() -> Iterator[type[RecomputePolicy]]:
    """The doc's toy policy, registered by its block (which prints what it plans); unregistered afterwards."""
    printed = io.StringIO()
    namespace: dict[str, object] = {"__name__": "recompute_policies_doc"}
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(doc_block(), str(DOC), "exec", dont_inherit=True), namespace)  # noqa: S102
        assert printed.getvalue().splitlines() == ["longest:1@4+anchored (4, None, 4)"]
        yield namespace["LongestPolicy"]
    finally:
        POLICIES.pop("longest", None)


def test_a_registered_policy_parses_prints_and_plans(longest: type[RecomputePolicy]) -> None:
    policy = RecomputePolicy.parse("longest:2@1+anchored")
    assert policy == longest(chunks=2, seam_tokens=1, anchored=True)
    assert policy.spec == "longest:2@1+anchored" and RecomputePolicy.from_dict(policy.to_dict()) == policy
    assert policy.resolved(SEAM) == policy and RecomputePolicy.parse("longest:1").resolved(SEAM).spec == "longest:1@4"
    assert policy.plan([5, 9, 3, 9], SEAM, [0, 1, 2, 3]).chunk_seams == (1, WHOLE, 1, WHOLE)
    # the base's checks hold for it: the range of its amount, its number form
    for bad, named in (("longest:0", "1..64"), ("longest:65", "1..64"), ("longest:1.5", "whole number"),
                       ("longest", "needs an amount")):
        with pytest.raises(RecomputePolicyError, match=named):
            RecomputePolicy.parse(bad)


def test_a_registered_policy_shows_in_help_errors_and_calibration(longest: type[RecomputePolicy]) -> None:
    from hypic_rag.cli.main import build_parser

    assert "longest:N[@W]" in spec_help() and "longest:N[@W] (the N longest chunks whole)" in policy_help()
    with pytest.raises(RecomputePolicyError, match=r"longest:N\[@W\]"):
        RecomputePolicy.parse("shortest:1")
    ask_help = " ".join(build_parser()._subparsers._group_actions[0].choices["ask"].format_help().split())
    assert "longest:N[@W] (the N longest chunks whole)" in ask_help
    specs = [policy.spec for policy in calibration_candidates()]
    assert specs.index("longest:1") == specs.index("whole:1") + 1  # by its position (2.5): after whole:1


def test_the_engine_runs_a_registered_policy_as_its_plan(longest: type[RecomputePolicy]) -> None:
    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=5)), seam_tokens=SEAM)
    request = random_request(3, [7, 12, 9])

    @dataclass(frozen=True)
    class Fixed:
        """The plan the toy policy makes for this request, given by hand (`PlansChunks`)."""

        def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()) -> RecomputePlan:
            return RecomputePlan((SEAM, WHOLE, SEAM))

    toy = engine.prefill(request, "hypic", policy="longest:1")
    fixed = engine.prefill(request, "hypic", policy=Fixed())
    assert toy.stats.recomputed_tokens == fixed.stats.recomputed_tokens
    torch.testing.assert_close(toy.logits, fixed.logits, rtol=0, atol=0)
    assert not torch.equal(toy.logits, engine.prefill(request, "hypic", policy="seam").logits)


def test_the_registry_refuses_a_kind_twice_and_an_unregistered_class(longest: type[RecomputePolicy]) -> None:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Again(RecomputePolicy):
        kind: ClassVar[str] = "longest"

    with pytest.raises(ValueError, match="registered already"):
        register_policy(Again)
    with pytest.raises(RecomputePolicyError, match="not a registered recompute policy"):
        Again()
    with pytest.raises(ValueError, match="lower-case letters"):
        register_policy(type("Odd", (longest,), {"kind": "Odd2"}))
