"""One object carries how a request is assembled (mode, seam window, recompute policy) from the caller to the stack:
`Assembly` is checked when made, resolved against the engine's defaults into the request plan, and the plan's stack
item hands it to the pass, which reads what the mode asks of it."""

from __future__ import annotations

import pytest
import torch

from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODE_TABLE, UnknownModeError
from hypic_rag.runtime.recompute_policy import SEAM_POLICY, RecomputePolicy, RecomputePolicyError
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.stack import run_stack
from hypic_rag.testing import build_tiny_model


def test_an_assembly_is_checked_when_made_and_reads_the_mode_table() -> None:
    with pytest.raises(UnknownModeError, match="unknown mode"):
        Assembly("fastest")
    with pytest.raises(ValueError):
        Assembly("hypic", seam_tokens=-1)
    with pytest.raises(RecomputePolicyError):
        Assembly("hypic", policy="whole:x")
    assert Assembly("hypic", policy="whole:2").policy == RecomputePolicy.parse("whole:2")
    for name, spec in MODE_TABLE.items():
        assembly = Assembly(name)
        assert (assembly.reposition_keys, assembly.composition) == (spec.reposition_keys, spec.composition)
    assert Assembly.of(None) == Assembly() and Assembly.of("full") == Assembly("full")
    given = Assembly("prefix", 3)
    assert Assembly.of(given) is given


def test_the_engine_resolves_what_an_assembly_leaves_open() -> None:
    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=1)), seam_tokens=6, recompute_policy="whole:1")
    assert engine.assembly("hypic") == Assembly("hypic", 6, RecomputePolicy.parse("whole:1"))
    assert engine.assembly(Assembly("hypic", 2)) == Assembly("hypic", 2, RecomputePolicy.parse("whole:1"))
    assert engine.assembly("hypic", seam_tokens=4, policy="seam") == Assembly("hypic", 4, SEAM_POLICY)
    assert engine.assembly(Assembly("transition", policy="seam"), seam_tokens=3) == Assembly("transition", 3, SEAM_POLICY)


def test_the_plan_carries_the_assembly_to_the_stack() -> None:
    model = wrap_model(build_tiny_model("qwen3_5", seed=2))
    engine = Engine(model, seam_tokens=4)
    generator = torch.Generator().manual_seed(0)
    ids = lambda count: torch.randint(0, 256, (count,), generator=generator).tolist()  # noqa: E731
    request = Request(ids(3), [ids(12), ids(9), ids(14)], ids(4))
    chosen = Assembly("hypic", seam_tokens=2, policy="whole:1")
    plan = engine.plan_prefill(request, chosen)
    assert plan.assembly == engine.assembly(chosen) and plan.mode == "hypic"
    assert plan.item(reserve=5).assembly is plan.assembly and plan.item(reserve=5).reserve == 5
    # the seam and the policy reached the spans: one chunk whole (the highest ranked), the others seam 2
    recomputed = [span.recompute for span in plan.spans if span.entry is not None]
    assert recomputed == [0, 2, 2]  # the prefix's seam-0 entry, then the two chunks not recomputed whole
    alone = engine.prefill(request, chosen)
    torch.testing.assert_close(run_stack(model, plan.spans, assembly=plan.assembly).logits, alone.logits,
                               atol=1e-5, rtol=0)
    # the stack reads the mode from the item's assembly: keys at their standalone positions in `transition`
    transition = engine.plan_prefill(request, "transition")
    repositioned = run_stack(model, transition.spans, assembly=Assembly("transition_rope")).logits
    standalone = run_stack(model, transition.spans, assembly=transition.assembly).logits
    torch.testing.assert_close(standalone, engine.prefill(request, "transition").logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(repositioned, engine.prefill(request, "transition_rope").logits, atol=1e-5, rtol=0)
    assert not torch.allclose(repositioned, standalone, atol=1e-4)
