"""Every recompute policy spec form parses, prints, resolves and plans exactly as the tagged-union implementation
did before policies became registered classes: a table of specs x random chunk layouts, compared with the outputs
recorded at that branch point (`data/recompute_policy_table.json`; `python tests/runtime/test_recompute_policy_table.py`
rewrites it from the code of the day, which is only right when a change of plans is intended).

Bad specs keep their one-line errors, word for word."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from hypic_rag.runtime.recompute_policy import RecomputePolicy, RecomputePolicyError, calibration_candidates

TABLE = Path(__file__).with_name("data") / "recompute_policy_table.json"

SPECS = (
    "seam", "seam@0", "seam@5", "seam@16", "seam@65536", " seam@16 ", "seam+anchored", "seam+chained",
    "seam@0+anchored", "seam@0+chained", "seam@3+chained",
    "whole:1", "whole:2", "whole:3", "whole:4", "whole:9", "whole:4096", "whole:2@8", "whole:1@0", "whole:2@3+anchored",
    "whole:1+chained",
    "budget:1", "budget:1.5", "budget:2", "budget:3", "budget:10", "budget:10000", "budget:1.5@8", "budget:1.25@0",
    "budget:2+anchored", "budget:2+chained", "budget:3+anchored", "budget:2.0", "budget:1.50@4+chained",
    "tokens:1", "tokens:40", "tokens:80@0", "tokens:96@0", "tokens:200@6+anchored", "tokens:16777216", "tokens:50+chained",
)
"""Every form of docs/recompute_policies.md: kinds, amounts at their bounds, seams, suffixes, spellings."""

BAD_SPECS: tuple[Any, ...] = (
    "", "seams", "SEAM", "foo", "foo:1", "whole", "whole:0", "whole:1.5", "whole:4097", "whole:-1", "whole:2@",
    " whole : 1", "budget", "budget:0.5", "budget:10001", "budget:abc", "budget:2@x", "seam:3", "seam:1.5",
    "seam@65537", "seam@-1", "seam+anchored+chained", "seam+pinned", "tokens", "tokens:0", "tokens:1.5",
    "tokens:16777217", "x" * 200, 42, None,
)
"""Specs that are not valid, each with the error message it got."""

DEFAULT_SEAMS = (0, 4, 16)

CALIBRATION_CANDIDATES = ("seam", "budget:1.5", "whole:1", "budget:2", "whole:2", "budget:3", "whole:3", "whole:4",
                          "seam@0+anchored", "seam@0+chained", "seam+anchored", "seam+chained", "budget:1.5+anchored",
                          "budget:1.5+chained", "budget:2+anchored", "budget:2+chained", "budget:3+anchored",
                          "budget:3+chained")
"""What `hypic-rag calibrate` compares by default, in that order (of equal cost and KL the earlier is chosen, so the
order is part of the choice)."""


def layouts() -> list[dict[str, Any]]:
    """Random chunk layouts: lengths [n] (0..8 chunks, some of length 0 or 1), ranks [n] (none, a permutation, or
    with ties), the engine's seam."""
    rng = random.Random(46)
    cases = []
    for number in range(30):
        count = rng.randint(0, 8)
        lengths = [rng.choice([0, 1, 2, 3]) if rng.random() < 0.1 else rng.randint(1, 70) for _ in range(count)]
        shape = number % 3
        ranks = [] if shape == 0 else rng.sample(range(count), count) if shape == 1 else [
            rng.randint(0, 2) for _ in range(count)]
        cases.append({"lengths": lengths, "ranks": ranks, "default_seam": DEFAULT_SEAMS[number % len(DEFAULT_SEAMS)]})
    return cases


def outputs() -> dict[str, Any]:
    """What the code of the day makes of every spec and layout."""
    cases = layouts()
    specs: dict[str, Any] = {}
    for spec in SPECS:
        policy = RecomputePolicy.parse(spec)
        specs[spec] = {
            "kind": policy.kind, "spec": policy.spec, "anchored": policy.anchored, "chained": policy.chained,
            "seam_tokens": policy.seam_tokens,
            "resolved": {str(seam): policy.resolved(seam).spec for seam in DEFAULT_SEAMS},
            "entry_seams": {str(seam): sorted(policy.entry_seams(seam)) for seam in DEFAULT_SEAMS},
            "plans": [list(policy.plan(case["lengths"], case["default_seam"], case["ranks"]).chunk_seams)
                      for case in cases],
        }
    errors = {}
    for spec in BAD_SPECS:
        try:
            RecomputePolicy.parse(spec)
        except RecomputePolicyError as error:
            errors[repr(spec)] = str(error)
        else:  # pragma: no cover - the table names only bad specs
            raise AssertionError(f"{spec!r} parsed")
    return {"layouts": cases, "specs": specs, "errors": errors}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return json.loads(TABLE.read_text(encoding="utf-8"))


def test_the_layouts_are_the_recorded_ones(recorded: dict[str, Any]) -> None:
    assert layouts() == recorded["layouts"]


@pytest.mark.parametrize("spec", SPECS)
def test_a_spec_parses_prints_and_plans_as_recorded(spec: str, recorded: dict[str, Any]) -> None:
    assert outputs()["specs"][spec] == recorded["specs"][spec]


def test_bad_specs_keep_their_one_line_errors(recorded: dict[str, Any]) -> None:
    errors = outputs()["errors"]
    assert errors == recorded["errors"]
    assert all("\n" not in message and "policy" in message for message in errors.values())


def test_calibration_compares_the_same_candidates_in_the_same_order() -> None:
    assert tuple(policy.spec for policy in calibration_candidates()) == CALIBRATION_CANDIDATES


if __name__ == "__main__":
    TABLE.parent.mkdir(exist_ok=True)
    TABLE.write_text(json.dumps(outputs(), separators=(",", ":"), sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {TABLE}", file=sys.stderr)
