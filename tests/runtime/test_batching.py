"""Continuous batching is exact: a batch gives every sequence what it gets alone (fp32 logits within 1e-5,
identical tokens), for batched decode over sequences of different lengths, batched prefills of every mode, and
random mixes of requests arriving at different steps of the scheduler. The reference is the one-sequence path
(`Engine.prefill` / `Engine.decode_step` / `Engine.generate`: the same pass and step function with one sequence)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from hypic_rag.runtime.batch_state import SequenceState
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.segment_source import MemorySegmentSource
from hypic_rag.runtime.stack import decode_batch, run_batch
from hypic_rag.runtime.scheduler import (
    CallbackSink,
    QueueSink,
    Scheduler,
    SchedulerConfig,
    SchedulerFullError,
    SequenceCancelled,
)
from hypic_rag.testing import build_tiny_model
from scheduler_support import run_arrivals

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
ATOL = 1e-5


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model(request):
    return wrap_model(build_tiny_model(request.param, seed=3))


@pytest.fixture(scope="module")
def qwen35():
    return wrap_model(build_tiny_model("qwen3_5", seed=5))


def token_ids(generator: torch.Generator, count: int) -> list[int]:
    return torch.randint(0, 256, (count,), generator=generator).tolist()


def random_requests(seed: int, count: int, pool_size: int = 8) -> list[Request]:
    """Requests over a shared pool of chunks (so entries recur), with different chunk counts and lengths."""
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pool = [token_ids(generator, rng.randint(2, 40)) for _ in range(pool_size)]
    return [
        Request(token_ids(generator, rng.randint(0, 6)), [rng.choice(pool) for _ in range(rng.randint(0, 5))],
                token_ids(generator, rng.randint(1, 9)))
        for _ in range(count)
    ]


# ---------------------------------------------------------------------------------------------- batched decode
def test_batched_decode_equals_each_sequence_decoded_alone(model) -> None:
    engine = Engine(model, seam_tokens=4)
    requests = random_requests(0, 5)
    steps = 10
    alone_logits: list[list[torch.Tensor]] = []
    alone_tokens: list[list[int]] = []
    for request in requests:
        prefill = engine.prefill(request, "hypic")
        logits, state, tokens, trace = prefill.logits, prefill.state, [], [prefill.logits]
        for _ in range(steps):
            tokens.append(int(torch.argmax(logits)))
            logits, state = engine.decode_step(state, tokens[-1])
            trace.append(logits)
        alone_logits.append(trace)
        alone_tokens.append(tokens)
    prefills = [engine.prefill(request, "hypic") for request in requests]
    lengths = {prefill.state.length for prefill in prefills}
    assert len(lengths) > 2, "the sequences should have different lengths"
    states = [SequenceState.from_decode_state(prefill.state, reserve=3) for prefill in prefills]  # grows past 3
    logits = torch.stack([prefill.logits for prefill in prefills])
    batched_tokens: list[list[int]] = [[] for _ in requests]
    for step in range(steps):
        chosen = [int(torch.argmax(row)) for row in logits]
        for number, token in enumerate(chosen):
            batched_tokens[number].append(token)
        logits = decode_batch(model, states, chosen)
        for number in range(len(requests)):
            torch.testing.assert_close(logits[number], alone_logits[number][step + 1], atol=ATOL, rtol=0)
    assert batched_tokens == alone_tokens
    assert [state.length for state in states] == [prefill.state.length + steps for prefill in prefills]


# ---------------------------------------------------------------------------------------------- batched prefill
def test_batched_prefills_of_every_mode_equal_each_alone(model) -> None:
    engine = Engine(model, seam_tokens=4)
    requests = random_requests(1, 4)
    plans = [(request, mode, engine.plan_prefill(request, mode)) for request in requests for mode in MODES]
    results = run_batch(model, [plan.item(reserve=2) for _, _, plan in plans])
    for (request, mode, plan), result in zip(plans, results):
        alone = engine.prefill(request, mode)
        torch.testing.assert_close(result.logits, alone.logits, atol=ATOL, rtol=0, msg=f"mode {mode}")
        assert result.recomputed_tokens == alone.stats.recomputed_tokens
        # the state it leaves decodes on exactly as the one-sequence state does
        token = int(torch.argmax(alone.logits))
        expected, _ = engine.decode_step(alone.state, token)
        torch.testing.assert_close(decode_batch(model, [result.state], [token])[0], expected, atol=ATOL, rtol=0)


def test_prefix_mode_checkpoints_from_a_batch_serve_later_requests(qwen35) -> None:
    engine, reference = Engine(qwen35, seam_tokens=4), Engine(qwen35, seam_tokens=4)
    generator = torch.Generator().manual_seed(7)
    prefix, chunks = token_ids(generator, 5), [token_ids(generator, 12) for _ in range(3)]
    first = Request(prefix, chunks, token_ids(generator, 4))
    plan = engine.plan_prefill(first, "prefix")
    [result] = run_batch(qwen35, [plan.item()])
    engine.finish_prefill(plan, result)  # keeps the chunk-boundary checkpoints
    reference.prefill(first, "prefix")
    later = Request(prefix, chunks[:2] + [token_ids(generator, 9)], token_ids(generator, 3))
    batched, alone = engine.prefill(later, "prefix"), reference.prefill(later, "prefix")
    assert batched.stats.prefix_reused_tokens == alone.stats.prefix_reused_tokens == 5 + 24
    torch.testing.assert_close(batched.logits, alone.logits, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- the scheduler
def random_jobs(seed: int, count: int) -> list[tuple[Request, str, SamplingParams, int]]:
    """(request, mode, sampling, arrival step): every mode, greedy and sampled, different output lengths."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    pool = [token_ids(generator, rng.randint(2, 40)) for _ in range(8)]
    jobs = []
    for number in range(count):
        mode = MODES[number % len(MODES)]
        if mode == "prefix":  # own chunks: a checkpoint one request leaves would change what another reuses
            chunks = [token_ids(generator, rng.randint(3, 30)) for _ in range(rng.randint(0, 3))]
        else:
            chunks = [rng.choice(pool) for _ in range(rng.randint(0, 5))]
        request = Request(token_ids(generator, rng.randint(0, 6)), chunks, token_ids(generator, rng.randint(1, 9)))
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.9]),
                                seed=rng.randint(0, 1000), logprobs=3)
        jobs.append((request, mode, params, rng.randint(0, 12)))
    return jobs


def assert_same_generation(batched, alone) -> None:
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text and batched.finish_reason == alone.finish_reason
    for mine, theirs in zip(batched.logprobs, alone.logprobs, strict=True):
        assert mine.token_id == theirs.token_id
        assert abs(mine.logprob - theirs.logprob) < ATOL
        assert [token for token, _ in mine.top] == [token for token, _ in theirs.top]
        assert max(abs(a - b) for (_, a), (_, b) in zip(mine.top, theirs.top)) < ATOL


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixes_arriving_at_different_steps_equal_each_alone(qwen35, seed: int) -> None:
    """Cold segments (each engine starts with an empty cache), tight limits so that requests wait, encode over
    several steps and prefill in steps with running decodes."""
    jobs = random_jobs(seed, 18)
    reference = Engine(qwen35, seam_tokens=4)
    alone = [reference.generate(request, mode, params) for request, mode, params, _ in jobs]
    engine = Engine(qwen35, seam_tokens=4, segment_source=MemorySegmentSource())
    scheduler = Scheduler(engine, SchedulerConfig(max_running=5, step_tokens=48, encode_tokens=40))
    sinks, reports = run_arrivals(scheduler, jobs, max_steps=500)
    for number, sink in sinks.items():
        assert_same_generation(sink.future.result(timeout=0), alone[number])
    assert max(report.sequences for report in reports) > 1
    assert any(report.prefills and report.decodes for report in reports), "no step mixed prefills and decodes"
    assert any(report.encoded_tokens for report in reports)
    assert max(report.running for report in reports) <= 5
    assert scheduler.running == scheduler.waiting == 0


def test_cancelled_and_expired_sequences_leave_at_once_and_the_rest_are_exact(qwen35) -> None:
    engine = Engine(qwen35, seam_tokens=4)
    requests = random_requests(3, 4)
    params = SamplingParams(max_new_tokens=20, logprobs=2)
    alone = Engine(qwen35, seam_tokens=4).generate(requests[0], "hypic", params)
    scheduler = Scheduler(engine, SchedulerConfig(max_running=4, step_tokens=256))
    expired = threading.Event()

    def deadline() -> None:
        if expired.is_set():
            raise TimeoutError("past its deadline")

    sinks = [QueueSink() for _ in requests]
    sequences = [scheduler.submit(requests[0], "hypic", params, sink=sinks[0]),
                 scheduler.submit(requests[1], "hypic", params, sink=sinks[1]),
                 scheduler.submit(requests[2], "hypic", params, sink=sinks[2], check=deadline)]
    for _ in range(3):
        scheduler.step()
    assert scheduler.running == 3 and all(sequence.state is not None for sequence in sequences)
    sequences[1].cancel()
    expired.set()
    scheduler.step()
    assert scheduler.running == 1
    assert sequences[1].state is None and sequences[2].state is None  # freed
    with pytest.raises(SequenceCancelled):
        sinks[1].future.result(timeout=0)
    with pytest.raises(TimeoutError, match="deadline"):
        sinks[2].future.result(timeout=0)
    late = scheduler.submit(requests[3], "hypic", params, sink=sinks[3])  # admitted into the freed room
    late.cancel()  # cancelled while waiting: never admitted
    while scheduler.has_work:
        scheduler.step()
    assert_same_generation(sinks[0].future.result(timeout=0), alone)
    with pytest.raises(SequenceCancelled):
        sinks[3].future.result(timeout=0)


def test_concurrent_streams_from_threads_batch_and_equal_alone(qwen35) -> None:
    requests = random_requests(4, 6)
    params = SamplingParams(max_new_tokens=8)
    alone = [Engine(qwen35, seam_tokens=4).generate(request, "hypic", params) for request in requests]
    reports = []
    scheduler = Scheduler(Engine(qwen35, seam_tokens=4), on_step=reports.append)
    gate = threading.Barrier(len(requests))
    outcomes: dict[int, object] = {}

    def client(number: int) -> None:
        gate.wait()
        stream = scheduler.stream(requests[number], "hypic", params)
        text = "".join(delta for _, delta in stream)
        outcomes[number] = (text, stream.result)

    with scheduler.lock:  # hold the steps until every client has submitted
        scheduler.start()
        threads = [threading.Thread(target=client, args=(n,)) for n in range(len(requests))]
        for thread in threads:
            thread.start()
        while scheduler.waiting < len(requests):
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(60)
    scheduler.stop()
    for number, generation in enumerate(alone):
        text, result = outcomes[number]
        assert text == result.text == generation.text and result.token_ids == generation.token_ids
    assert max(report.sequences for report in reports) == len(requests)


@pytest.mark.parametrize("admit_wait_s", [0.0, 2.0])
def test_after_a_step_that_frees_slots_the_scheduler_waits_for_the_clients_next_requests(qwen35, admit_wait_s) -> None:
    """Closed loop: 4 clients each send 3 requests, one after the other, client n 10 (n + 1) ms after its previous
    answer. With
    `admit_wait_s` the next requests are admitted together (every prefill step holds all 4); without, the first
    one resent starts alone. The answers stay exact either way."""
    clients, rounds = 4, 3
    requests = random_requests(11, clients * rounds)
    params = SamplingParams(max_new_tokens=4, logit_bias={token: -100.0 for token in qwen35.eos_token_ids})
    alone = [Engine(qwen35, seam_tokens=4).generate(request, "hypic", params) for request in requests]
    reports = []
    scheduler = Scheduler(Engine(qwen35, seam_tokens=4), SchedulerConfig(max_running=clients, admit_wait_s=admit_wait_s),
                          on_step=reports.append)
    outcomes: dict[int, object] = {}

    def client(number: int) -> None:
        for turn in range(rounds):
            if turn:
                threading.Event().wait(0.01 * (number + 1))  # the client reads its answer before it asks again
            outcomes[number * rounds + turn] = scheduler.generate(requests[number * rounds + turn], "hypic", params)

    with scheduler.lock:  # the first round is submitted before the first step
        scheduler.start()
        threads = [threading.Thread(target=client, args=(n,)) for n in range(clients)]
        for thread in threads:
            thread.start()
        while scheduler.waiting < clients:
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(60)
    scheduler.stop()
    for number, generation in enumerate(alone):
        assert outcomes[number].token_ids == generation.token_ids
    prefill_steps = [report.prefills for report in reports if report.prefills]
    if admit_wait_s:
        assert prefill_steps == [clients] * rounds
    else:
        assert len(prefill_steps) > rounds


def test_the_waiting_queue_is_bounded_and_a_stream_closed_early_frees_its_sequence(qwen35) -> None:
    scheduler = Scheduler(Engine(qwen35, seam_tokens=4), SchedulerConfig(max_running=1, step_tokens=64, max_waiting=2))
    request = random_requests(5, 1)[0]
    tokens: list[int] = []
    scheduler.submit(request, "full", SamplingParams(max_new_tokens=30), sink=CallbackSink(lambda t, _: tokens.append(t)))
    scheduler.submit(request, "full", sink=CallbackSink())
    with pytest.raises(SchedulerFullError, match="waiting queue is full"):
        scheduler.submit(request, "full", sink=CallbackSink())
    scheduler.step()  # admits the first
    assert scheduler.waiting == 1 and scheduler.running == 1
    scheduler.start()
    stream = scheduler.stream(request, "full", SamplingParams(max_new_tokens=200))
    next(iter(stream))
    stream.close()  # its sequence is cancelled at the next step
    for _ in range(6000):
        if not scheduler.has_work:
            break
        threading.Event().wait(0.01)
    scheduler.stop()
    assert len(tokens) == 30 and scheduler.running == scheduler.waiting == 0


@pytest.mark.parametrize("options", [dict(max_running=0), dict(step_tokens=0), dict(max_waiting=-1),
                                     dict(encode_tokens=0), dict(max_running=8, step_tokens=4), dict(max_running=1.5),
                                     dict(admit_wait_s=-0.1), dict(admit_wait_s=True)])
def test_scheduler_config_is_checked(options: dict) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**options)


# ---------------------------------------------------------------------------------------------- policies, families
@pytest.mark.parametrize("engine_policy", [None, "whole:1"])
def test_the_scheduler_applies_each_requests_recompute_policy(qwen35, engine_policy) -> None:
    """A sequence's `hypic` prefill is planned under its own policy (None: the engine's): tokens, logprobs and the
    token accounting (recomputed, encoded, per-segment reuse) equal `Engine.generate` with that policy; chunks a
    policy recomputes whole get no entry encoded."""
    requests = random_requests(11, 6, pool_size=5)
    requests = [request for request in requests if len(request.chunk_ids) >= 2] or requests[:1]
    policies = [None, "seam@2", "whole:1", "whole:9", "budget:2", "seam@0+anchored", "whole:1+anchored"]
    jobs = [(request, policy) for request in requests for policy in policies]
    params = SamplingParams(max_new_tokens=4, logprobs=2)
    reference = Engine(qwen35, seam_tokens=4, recompute_policy=engine_policy)
    alone = []
    for request, policy in jobs:  # each alone from a cold cache, as the scheduler's engine starts
        reference.segment_source = MemorySegmentSource()
        alone.append(reference.generate(request, "hypic", params, policy=policy))
    sinks = [QueueSink() for _ in jobs]
    for (request, policy), sink in zip(jobs, sinks):
        engine = Engine(qwen35, seam_tokens=4, recompute_policy=engine_policy)
        scheduler = Scheduler(engine, SchedulerConfig(max_running=4, step_tokens=128, encode_tokens=32))
        scheduler.submit(request, "hypic", params, sink=sink, policy=policy)
        while scheduler.has_work:
            scheduler.step()
    whole_everything = [number for number, (_, policy) in enumerate(jobs) if policy == "whole:9"]
    for sink, expected in zip(sinks, alone):
        generation = sink.future.result(timeout=0)
        assert_same_generation(generation, expected)
        for name in ("recomputed_tokens", "encoded_tokens", "cached_tokens", "segment_reused_tokens"):
            assert getattr(generation.prefill, name) == getattr(expected.prefill, name), name
    for number in whole_everything:  # every chunk recomputed whole: only the prefix's entry is read
        request = jobs[number][0]
        stats = sinks[number].future.result(timeout=0).prefill
        assert stats.recomputed_tokens >= sum(len(chunk) for chunk in request.chunk_ids) + len(request.question_ids)
        assert stats.encoded_tokens <= len(request.prefix_ids)
    # together in one scheduler (a shared cache): the same tokens as alone
    engine = Engine(qwen35, seam_tokens=4, recompute_policy=engine_policy)
    scheduler = Scheduler(engine, SchedulerConfig(max_running=8, step_tokens=256))
    together = [QueueSink() for _ in jobs]
    for (request, policy), sink in zip(jobs, together):
        scheduler.submit(request, "hypic", params, sink=sink, policy=policy)
    while scheduler.has_work:
        scheduler.step()
    for sink, expected in zip(together, alone):
        assert_same_generation(sink.future.result(timeout=0), expected)


def test_scheduler_batches_a_family_beyond_qwen() -> None:
    """granitemoehybrid (Mamba2 / SSD + NoPE attention) goes through the same batched pass as the Qwen families:
    several sequences per step, cold segments encoded over steps, every mode, and exactly the tokens each request
    gets alone (every family: tests/runtime/test_batching_families.py)."""
    model = wrap_model(build_tiny_model("granitemoehybrid", seed=3))
    jobs = random_jobs(2, 10)
    reference = Engine(model, seam_tokens=4)
    alone = [reference.generate(request, mode, params) for request, mode, params, _ in jobs]
    engine = Engine(model, seam_tokens=4)
    scheduler = Scheduler(engine, SchedulerConfig(max_running=4, step_tokens=64, encode_tokens=40))
    sinks, reports = run_arrivals(scheduler, jobs, max_steps=500)
    for number, sink in sinks.items():
        assert_same_generation(sink.future.result(timeout=0), alone[number])
    assert max(report.sequences for report in reports) > 1
    assert any(report.encoded_tokens for report in reports)
    assert scheduler.running == scheduler.waiting == 0


def test_a_stream_of_an_idle_scheduler_runs_its_steps_in_the_consumers_thread(qwen35) -> None:
    """Nobody runs the scheduler's steps (it was not started): iterating its stream steps it, one sequence per
    step, with exactly the tokens of `Engine.generate`."""
    request = random_requests(6, 1)[0]
    params = SamplingParams(max_new_tokens=6, logprobs=2)
    alone = Engine(qwen35, seam_tokens=4).generate(request, "hypic", params)
    reports = []
    scheduler = Scheduler(Engine(qwen35, seam_tokens=4), on_step=reports.append)
    stream = scheduler.stream(request, "hypic", params)
    assert reports == []  # nothing runs before the stream is iterated
    text = "".join(delta for _, delta in stream)
    assert_same_generation(stream.result, alone)
    assert text == alone.text and len(reports) >= len(alone.token_ids)
    assert all(report.sequences == 1 for report in reports if report.sequences)
