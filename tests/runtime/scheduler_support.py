"""Driving a scheduler by hand with requests that arrive at given steps (the batching tests)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.scheduler import QueueSink, Scheduler


def run_arrivals(
    scheduler: Scheduler, jobs: Sequence[tuple[Request, str, SamplingParams, int]], max_steps: int
) -> tuple[dict[int, QueueSink], list[Any]]:
    """Step `scheduler` in this thread, submitting job n (request, mode, params, arrival step) at its arrival step,
    until every job was submitted and no work is left (at most `max_steps` steps, else AssertionError). Returns
    each job's sink by number and the step reports (`Scheduler.on_step`)."""
    reports: list[Any] = []
    scheduler.on_step = reports.append
    sinks: dict[int, QueueSink] = {}
    step = 0
    while len(sinks) < len(jobs) or scheduler.has_work:
        for number, (request, mode, params, arrival) in enumerate(jobs):
            if arrival == step:
                sinks[number] = QueueSink()
                scheduler.submit(request, mode, params, sink=sinks[number])
        scheduler.step()
        step += 1
        assert step < max_steps, f"the scheduler did not finish {len(jobs)} jobs in {max_steps} steps"
    return sinks, reports
