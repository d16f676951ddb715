"""The one ops registry (`hypic_rag.runtime.ops.registry`): it takes the backend the per-op dispatchers took before it
for the same inputs, devices, dtypes and HYPIC_RAG_KERNELS, and an op with no eligible backend runs its naive
reference. The rules the dispatchers had are written out here as the oracle (`former_choice`)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from hypic_rag.runtime.ops import backends, registry
from hypic_rag.runtime.ops.compose import select_backend as select_compose_backend
from hypic_rag.runtime.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from hypic_rag.runtime.ops.gated_delta_rule import select_backend as select_gated_delta_rule_backend
from hypic_rag.runtime.ops.kda import select_kda_backend
from hypic_rag.runtime.ops.lightning import select_lightning_backend
from hypic_rag.runtime.ops.selective_scan import select_backend as select_selective_scan_backend
from hypic_rag.runtime.ops.ssd import select_backend as select_ssd_backend

FLA_OP = {"gated_delta_rule": "gated_delta_rule", "kda": "kda", "lightning": "simple_gla", "ssd": "simple_gla"}
SELECTORS = {
    "gated_delta_rule": select_gated_delta_rule_backend,
    "kda": select_kda_backend,
    "lightning": select_lightning_backend,
    "ssd": select_ssd_backend,
}


def former_choice(op: str, probe: torch.Tensor, longest: int | None, fla: bool) -> str:
    """What the per-op dispatchers picked: fla (fused recurrent at <= 4 tokens) where fla may run and there is a
    token, else the step recurrence at <= 4 tokens, else the chunked form."""
    few = (probe.shape[2] if longest is None else longest) <= 4
    if probe.shape[2] > 0 and fla:
        return "fla_recurrent" if few else "fla"
    return "recurrent" if few else "chunk"


@pytest.mark.parametrize("op", sorted(SELECTORS))
@pytest.mark.parametrize("fla", [False, True])
def test_recurrences_pick_what_their_dispatchers_picked(op: str, fla: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every length around the recurrent threshold, packed or not, with fla able to run (as on a CUDA machine with
    fla installed: `use_fla` says so) or not; the fla op asked about is the op's own."""
    asked: list[str] = []

    def use_fla(tensor: torch.Tensor, fla_op: str) -> bool:
        asked.append(fla_op)
        return fla

    monkeypatch.setattr(backends, "use_fla", use_fla)
    for length in (0, 1, 4, 5, 40):
        probe = torch.zeros(1, 2, length, 8)
        for longest in (None, 1, 4, 5):
            expected = former_choice(op, probe, longest, fla)
            assert SELECTORS[op](probe, longest) == expected, (length, longest)
            assert registry.select(op, probe, longest) == expected
    assert set(asked) == {FLA_OP[op]}


def test_cpu_tensors_in_auto_mode_never_take_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "auto")
    for op in SELECTORS:
        assert registry.select(op, torch.zeros(1, 2, 3, 8)) == "recurrent"
        assert registry.select(op, torch.zeros(1, 2, 40, 8)) == "chunk"
    for length in (1, 4, 5, 512):  # Mamba1: the step path at every length on CPU
        assert select_selective_scan_backend(torch.zeros(1, 16, length)) == "recurrent"
    for op, probe in (("stitch_conv_tails", torch.zeros(3, 4, 2)), ("rotate_into", torch.zeros(2, 8, 4))):
        assert registry.select(op, probe) == "torch"
        assert registry.select(op, probe, requested="triton") == "triton"


@pytest.mark.parametrize("mode", ["auto", "torch", "triton"])
def test_compose_takes_a_kernel_only_where_one_composes_the_kind(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As before: the Triton switch (HYPIC_RAG_KERNELS, or `backend=`), and a kernel for the maps' kind on the
    state's layout: matrix P on [H, K, V]; scalar / vector P on [H, K, V] or [D, N]."""
    monkeypatch.setenv("HYPIC_RAG_KERNELS", mode)
    on = mode == "triton"
    cases = [
        (torch.zeros(2, 4, 4), "matrix", on), (torch.zeros(4, 4), "matrix", False),
        (torch.zeros(2, 4, 4), "scalar", on), (torch.zeros(8, 4), "vector", on),
        (torch.zeros(1, 2, 4, 4), "scalar", False), (torch.zeros(2, 4, 4), "other", False),
    ]
    for state, kind, triton in cases:
        assert select_compose_backend(state, kind) == ("triton" if triton else "torch"), (state.shape, kind)
        assert select_compose_backend(state, kind, "torch") == "torch"
        forced = select_compose_backend(state, kind, "triton")
        assert forced == ("triton" if (kind, state.dim()) in {("matrix", 3), ("scalar", 3), ("vector", 2)} else "torch")
    with pytest.raises(ValueError, match="unknown backend"):
        select_compose_backend(torch.zeros(2, 4, 4), "matrix", "cuda")


def test_the_blocked_scan_needs_cuda_and_more_than_a_few_tokens() -> None:
    """Mamba1's rule (`x.is_cuda and T > 4`), probed with a stand-in carrying a CUDA tensor's flag and shape (this
    machine has no CUDA tensor to probe with)."""

    class Probe:
        is_cuda = True
        shape = (1, 16, 5)

        @staticmethod
        def dim() -> int:
            return 3

    assert registry.select("selective_scan", Probe()) == "blocked"  # type: ignore[arg-type]
    Probe.shape = (1, 16, 4)
    assert registry.select("selective_scan", Probe()) == "recurrent"  # type: ignore[arg-type]


def test_an_op_with_no_eligible_backend_runs_its_naive_reference(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An op whose only fast backend never applies: the dispatch names "naive", runs the reference (bit for bit) and
    says so at debug level."""
    op = registry.Op(
        "gated_delta_rule_without_fast_path",
        "hypic_rag.runtime.ops.gated_delta_rule.naive:naive_recurrent_gated_delta_rule",
        (registry.Backend("chunk", "hypic_rag.runtime.ops.gated_delta_rule.chunk:chunk_gated_delta_rule",
                          lambda probe: False),),
        registry.time_steps_of("query"),
    )
    monkeypatch.setitem(registry.OPS, op.name, op)

    @registry.dispatch(op.name, like=naive_recurrent_gated_delta_rule)
    def run(*args, **kwargs):
        """The op above."""

    generator = torch.Generator().manual_seed(0)
    query, key = (torch.nn.functional.normalize(torch.randn(1, 2, 9, 4, generator=generator), dim=-1) for _ in "qk")
    value = torch.randn(1, 2, 9, 3, generator=generator)
    log_decay, beta = -torch.rand(1, 2, 9, generator=generator), torch.rand(1, 2, 9, generator=generator)
    assert registry.select(op.name, query) == "naive"
    with caplog.at_level(logging.DEBUG, logger="hypic_rag.runtime.ops.registry"):
        output, final = run(query, key, value, log_decay, beta)
    expected_output, expected_final = naive_recurrent_gated_delta_rule(query, key, value, log_decay, beta)
    assert torch.equal(output, expected_output) and torch.equal(final, expected_final)
    assert "running its reference" in caplog.text


def test_every_op_names_a_reference_and_backends_that_exist() -> None:
    """Each registered "module:function" names a function: the torch ones import and take the op's argument names;
    the kernels' are found in their module's source (not imported: triton stays out of this process)."""
    for op in registry.OPS.values():
        for target in [op.reference] + [backend.run for backend in op.backends]:
            module, _, name = target.partition(":")
            if module.startswith("hypic_rag.kernels"):
                spec = importlib.util.find_spec(module)
                assert spec is not None and f"def {name}(" in Path(spec.origin).read_text(encoding="utf-8"), target
                continue
            function, takes = registry._loaded(target)
            assert callable(function) and takes, target
        assert op.backends[-1].when(registry.Probe(None)), op.name  # the last backend takes every call
