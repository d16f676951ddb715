"""Every family batches exactly: 8 requests in random modes, arriving at different steps of the scheduler (cold
segments encoded over steps, decode steps among prefills), each get the logits (fp32, 1e-5) and the greedy tokens
they get alone (`Engine.generate`: the same step function with one sequence)."""

from __future__ import annotations

import random

import pytest
import torch

from hypic_rag.runtime.engine import Engine, Generating
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.stack import StackItemResult
from hypic_rag.runtime.scheduler import Scheduler, SchedulerConfig
from hypic_rag.testing import SUPPORTED_TINY_TYPES, build_tiny_model
from scheduler_support import run_arrivals

ATOL = RTOL = 1e-5
"""fp32 round-off of products over more rows, against the scale of the logits vector: every logit of a vector within
1e-5 times its largest |logit| (at least 1e-5 absolute). A product's round-off follows the size of its largest
terms, not of each result, so a small logit beside large ones carries their absolute error: LFM2's tiny model
reaches |logit| ~ 5, and on one 2-core machine (AVX-512 without bf16 or AMX; the test had passed elementwise on the
machine of earlier sessions) one logit of 0.048 differed by 1.13e-5 from alone: 2e-6 of the vector's scale."""


def assert_logits_close(mine: torch.Tensor, theirs: torch.Tensor, message: str) -> None:
    """`mine` equals `theirs` ([vocab] logits) up to fp32 round-off at the vector's scale (`ATOL`)."""
    scale = max(1.0, float(theirs.abs().max()))
    torch.testing.assert_close(mine, theirs, atol=ATOL * scale, rtol=RTOL, msg=lambda text: f"{message}: {text}")


def _jobs(seed: int, vocab: int, eos: set[int]) -> list[tuple[Request, str, SamplingParams, int]]:
    """8 (request, mode, greedy sampling, arrival step): chunks from a shared pool (prefix mode: its own, so that
    no checkpoint one request leaves changes what another reuses), answers of 2 to 6 tokens (end of sequence
    banned, so every request decodes)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)

    def ids(count: int) -> list[int]:
        return torch.randint(0, vocab, (count,), generator=generator).tolist()

    pool = [ids(rng.randint(3, 24)) for _ in range(6)]
    jobs = []
    for _ in range(8):
        mode = rng.choice(MODES)
        count = rng.randint(0, 4)
        chunks = ([ids(rng.randint(3, 20)) for _ in range(count)] if mode == "prefix"
                  else [rng.choice(pool) for _ in range(count)])
        params = SamplingParams(max_new_tokens=rng.randint(2, 6), logit_bias={token: -100.0 for token in eos})
        jobs.append((Request(ids(rng.randint(0, 5)), chunks, ids(rng.randint(1, 7))), mode, params, rng.randint(0, 5)))
    return jobs


Traces = dict[Generating, tuple[Request, list[torch.Tensor]]]


def _recorded(engine: Engine, traces: Traces) -> Engine:
    """`engine` whose step function's results are recorded: per generation its request and every logits vector it
    takes (the first one ends its prefill)."""
    take = engine.take

    def recording(generation: Generating, result: StackItemResult):
        if generation not in traces:
            assert generation.plan is not None
            traces[generation] = (generation.plan.request, [])
        traces[generation][1].append(result.logits.clone())
        return take(generation, result)

    engine.take = recording  # type: ignore[method-assign]
    return engine


@pytest.mark.parametrize("model_type", SUPPORTED_TINY_TYPES)
def test_a_batch_of_eight_arriving_at_different_steps_equals_each_alone(model_type: str) -> None:
    model = wrap_model(build_tiny_model(model_type, seed=11))
    vocab = min(256, model.hf_model.config.get_text_config().vocab_size)
    jobs = _jobs(sum(map(ord, model_type)), vocab, model.eos_token_ids)
    alone_traces: Traces = {}
    reference = _recorded(Engine(model, seam_tokens=4), alone_traces)
    alone = []
    for request, mode, params, _ in jobs:
        alone.append((reference.generate(request, mode, params), list(alone_traces.values())[-1][1]))

    traces: Traces = {}
    engine = _recorded(Engine(model, seam_tokens=4), traces)
    scheduler = Scheduler(engine, SchedulerConfig(max_running=8, step_tokens=96, encode_tokens=48))
    sinks, reports = run_arrivals(scheduler, jobs, max_steps=300)
    job_of = {id(request): number for number, (request, _, _, _) in enumerate(jobs)}
    batched = {job_of[id(request)]: trace for request, trace in traces.values()}
    for number, (generation, expected) in enumerate(alone):
        got = sinks[number].future.result(timeout=0)
        assert got.token_ids == generation.token_ids, f"job {number} ({jobs[number][1]})"
        assert len(batched[number]) == len(expected) == len(generation.token_ids)
        for mine, theirs in zip(batched[number], expected):
            assert_logits_close(mine, theirs, f"job {number} ({jobs[number][1]})")
    assert max(report.sequences for report in reports) > 1
    assert any(report.prefills and report.decodes for report in reports), "no step mixed prefills and decodes"
    assert scheduler.running == scheduler.waiting == 0

