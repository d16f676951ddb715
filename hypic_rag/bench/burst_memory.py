"""Reliability under repeated bursts: the resident memory of the service's processes, burst after burst.

The real service (`hypic-rag serve`, a process of its own on 127.0.0.1, `--workers N` model processes behind its
endpoint, or the single-process server with 1) over the bundled default model and a corpus it never saw
(`foreign_corpus`). Each burst opens `streams` streamed `/v1/ask` requests at once; every other one is abandoned
after its first event (the client closes the connection), the rest are read to their end and compared with the
answer the same question got alone. After each burst, once the server is idle again (`settle_s`), the resident
set (VmRSS) of the server's process and of each process below it is read from /proc, with its split by kind of
mapping (`mapping_rss_mib`) and its thread count. The row: those per process per burst (MiB), the growth of the
largest worker from the first burst to the last and over the last half, the answers that differed, and the
allocator and oneDNN cache settings the server ran with (`REPORTED_VARIABLES`). `--compare-with NAME=VALUE` runs the
same bursts first with that variable set for the server, then as configured: both rows in one file.

    python -m hypic_rag.bench.burst_memory --bursts 20 --streams 64 --workers 2 --json out.json
    python -m hypic_rag.bench.burst_memory --bursts 20 --compare-with LRU_CACHE_CAPACITY=1024 --json out.json

`--decode-cost` measures instead what bounding oneDNN's caches costs in decode speed: the bundled model's batched
decode (tokens per second of decode steps alone), rounds of random batch sizes whose prefills have lengths never
seen before (as a service's), each cache setting in a process of its own (both caches are read once per process),
the settings alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MIB = 1 << 20


def rss_mib(pid: int) -> float | None:
    """The resident set of process `pid` in MiB (VmRSS), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        return None
    return None


def mapping_rss_mib(pid: int) -> dict[str, float] | None:
    """The resident set of process `pid` by kind of mapping (MiB, from /proc/<pid>/smaps): `heap` (the brk heap,
    glibc's main arena), `anon` (anonymous mappings: glibc's thread arenas, large mmap'd blocks, thread stacks,
    other allocators' chunks), `file` (mapped files: libraries, the model's weights, the LMDB map), and `anon_maps`
    (how many anonymous mappings there are); None when it is gone."""
    totals = {"heap": 0.0, "anon": 0.0, "file": 0.0, "anon_maps": 0.0}
    kind = "anon"
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            path = fields[5] if len(fields) > 5 else ""
            kind = "heap" if path == "[heap]" else "file" if path.startswith("/") else "anon"
            if kind == "anon":
                totals["anon_maps"] += 1
        elif fields[0] == "Rss:":
            totals[kind] += int(fields[1]) * 1024 / MIB
    return {key: round(value, 1) for key, value in totals.items()}


def thread_count(pid: int) -> int | None:
    """How many threads process `pid` has now, None when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


def _reading(tree: list[int]) -> dict[str, Any]:
    """One reading of the processes in `tree`: RSS, RSS by kind of mapping and thread count, per process."""
    return {"rss_mib": {str(pid): rss_mib(pid) for pid in tree},
            "mappings_mib": {str(pid): mapping_rss_mib(pid) for pid in tree},
            "threads": {str(pid): thread_count(pid) for pid in tree}}


def _kinds(row: dict[str, Any], pid: int) -> str:
    """A reading's mapping kinds and thread count of process `pid`, for the log."""
    kinds = row["mappings_mib"].get(str(pid)) or {}
    return f"{kinds.get('heap', 0):.0f}/{kinds.get('anon', 0):.0f}/{kinds.get('file', 0):.0f}, {row['threads'].get(str(pid))}"


REPORTED_VARIABLES = ("MALLOC_ARENA_MAX", "LD_PRELOAD", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""The environment variables a row records (the server inherits them): allocator and oneDNN cache settings."""


async def _stream(client: Any, question: str, top_k: int, new_tokens: int, abandon: bool) -> str | None:
    """One streamed `/v1/ask`: its answer, or None when abandoned after the first event; RuntimeError when it
    failed."""
    body = {"question": question, "top_k": top_k, "max_new_tokens": new_tokens, "stream": True}
    async with client.stream("POST", "/v1/ask", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/v1/ask answered {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if abandon:
                return None  # leaving the block closes the connection mid-stream
            event = json.loads(line[len("data: "):])
            if event.get("type") == "done":
                return str(event["answer"])
            if event.get("type") == "error" or "error" in event:
                raise RuntimeError(line)
    raise RuntimeError("the stream ended without a done event")


async def _burst(url: str, questions: list[str], streams: int, top_k: int, new_tokens: int,
                 first: int) -> tuple[dict[int, str], int]:
    """`streams` streams at once (each on its own connection): (the answers of those read to their end, how many
    failed)."""
    import httpx

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        numbers = range(first, first + streams)
        results = await asyncio.gather(*(
            _stream(client, questions[number % len(questions)], top_k, new_tokens, abandon=number % 2 == 1)
            for number in numbers), return_exceptions=True)
    failed = [result for result in results if isinstance(result, BaseException)]
    for error in failed[:1]:
        logger.warning("%d of %d streams failed, e.g. %s", len(failed), streams, error)
    return {number: answer for number, answer in zip(numbers, results) if isinstance(answer, str)}, len(failed)


def burst_memory(*, bursts: int = 20, streams: int = 64, workers: int = 2, top_k: int = 4, new_tokens: int = 16,
                 settle_s: float = 2.0, max_seconds: float = 900.0,
                 environment: dict[str, str] | None = None) -> dict[str, Any]:
    """The row (see the module docstring). Stops early (`stopped_early`) past `max_seconds` of bursts.
    environment: variables the server runs with on top of this process's."""
    from hypic_rag.bench.foreign_corpus import questions
    from hypic_rag.bench.server_clients import AskClient, foreign_corpus_server, process_tree

    asked = questions()
    rows: list[dict[str, Any]] = []
    differing = failed_streams = 0
    began = time.monotonic()
    with foreign_corpus_server(workers, max(256, 4 * streams), environment=environment) as (url, server):
        client = AskClient(url)
        try:
            reference = [client.ask(question, top_k, new_tokens)[2][0] for question in asked]
        finally:
            client.close()
        time.sleep(settle_s)
        rows.append({"burst": 0, **_reading(process_tree(server.pid))})
        for burst in range(1, bursts + 1):
            if time.monotonic() - began > max_seconds:
                break
            answers, failed = asyncio.run(_burst(url, asked, streams, top_k, new_tokens, first=burst * streams))
            failed_streams += failed
            differing += sum(answer != reference[number % len(asked)] for number, answer in answers.items())
            time.sleep(settle_s)
            tree = process_tree(server.pid)
            rows.append({"burst": burst, **_reading(tree)})
            logger.info("burst %d: RSS (heap/anon/file, threads) %s", burst, ", ".join(
                f"{rss_mib(pid) or 0:.0f} MiB ({_kinds(rows[-1], pid)})" for pid in tree))
    front = str(server.pid)
    worker_pids = sorted({pid for row in rows for pid in row["rss_mib"] if pid != front})

    def largest(row: dict[str, Any]) -> float:
        values = [row["rss_mib"].get(pid) or 0.0 for pid in worker_pids] or [row["rss_mib"].get(front) or 0.0]
        return max(values)

    half = rows[len(rows) // 2] if len(rows) > 2 else rows[0]
    return {
        "benchmark": "burst_memory",
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "workers": workers,
        "streams_per_burst": streams,
        "bursts": len(rows) - 1,
        "stopped_early": len(rows) - 1 < bursts,
        "abandoned_per_burst": streams // 2,
        "environment": {name: {**os.environ, **(environment or {})}.get(name) for name in REPORTED_VARIABLES},
        "front_pid": front,
        "rss_mib_per_burst": rows,
        "largest_process_mib": [round(largest(row), 1) for row in rows],
        "growth_mib_first_to_last": round(largest(rows[-1]) - largest(rows[1 if len(rows) > 1 else 0]), 1),
        "growth_mib_last_half": round(largest(rows[-1]) - largest(half), 1),
        "answers_differing_from_alone": differing,
        "failed_streams": failed_streams,
        "seconds": round(time.monotonic() - began, 1),
    }


CACHE_SETTINGS: dict[str, dict[str, str]] = {
    "unbounded (oneDNN 1024, ideep 1024)": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "1024"},
    "oneDNN 128, ideep 1024": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128", "LRU_CACHE_CAPACITY": "1024"},
    "bounded (oneDNN 128, ideep 128: the default)": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128",
                                                      "LRU_CACHE_CAPACITY": "128"},
}
"""The cache settings `decode_cost` compares: the capacities of oneDNN's primitive cache and of ideep's cache of
primitive descriptors (PyTorch's oneDNN glue), as environment variables."""


def decode_speed(rounds: int = 24, max_batch: int = 16, new_tokens: int = 16, seed: int = 0) -> dict[str, float]:
    """This process's batched decode speed on the bundled model: `rounds` rounds, each a batch of 1..`max_batch`
    sequences (random; prompts of random lengths, `full` mode) prefilled in one step and decoded `new_tokens` steps;
    only the decode steps are timed. Returns decode tokens, seconds and tokens per second."""
    import numpy as np
    import torch

    from hypic_rag.demo.default_model import default_model_path
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model
    from hypic_rag.runtime.request import Request
    from hypic_rag.runtime.sampling import SamplingParams

    torch.set_num_threads(1)
    model = load_model(default_model_path(), device="cpu")
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=new_tokens, logit_bias={token: -100.0 for token in model.eos_token_ids})
    random = np.random.default_rng(seed)
    vocab = int(model.config.vocab_size)
    tokens, seconds = 0, 0.0
    with torch.inference_mode():
        for _ in range(rounds):
            batch = int(random.integers(1, max_batch + 1))
            requests = [Request(random.integers(3, vocab, 8).tolist(),
                                [random.integers(3, vocab, int(random.integers(16, 160))).tolist()],
                                random.integers(3, vocab, 12).tolist()) for _ in range(batch)]
            generations = [engine.start(request, "full", params) for request in requests]
            for generation, result in zip(generations, engine.step(generations)):  # the prefills, not timed
                engine.take(generation, result)
            began = time.perf_counter()
            while live := [generation for generation in generations if not generation.finished]:
                for generation, result in zip(live, engine.step(live)):
                    engine.take(generation, result)
                tokens += len(live)
            seconds += time.perf_counter() - began
    return {"decode_tokens": tokens, "decode_seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 1)}


def decode_cost(repeats: int = 3) -> dict[str, Any]:
    """`decode_speed` under each of `CACHE_SETTINGS`, each run a process of its own, the settings alternating
    `repeats` times: per setting its runs and their median tokens per second, and each median's ratio to the
    unbounded one."""
    import statistics
    import subprocess
    import sys

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CACHE_SETTINGS}
    for repeat in range(repeats):
        for name, variables in CACHE_SETTINGS.items():
            output = subprocess.run([sys.executable, "-m", "hypic_rag.bench.burst_memory", "--decode-probe"],
                                    env={**os.environ, **variables}, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(output.stdout.strip().splitlines()[-1]))
            logger.info("decode, %s, run %d: %.1f tokens/s", name, repeat + 1, runs[name][-1]["tokens_per_second"])
    medians = {name: statistics.median(run["tokens_per_second"] for run in values) for name, values in runs.items()}
    unbounded = next(iter(medians.values()))
    return {
        "benchmark": "burst_memory_decode_cost",
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "model": "bundled default model",
        "settings": CACHE_SETTINGS,
        "runs": runs,
        "median_tokens_per_second": medians,
        "ratio_to_unbounded": {name: round(value / unbounded, 3) for name, value in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams per burst (half abandoned)")
    parser.add_argument("--workers", type=int, default=2, help="the server's --workers (1: the single server)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle before each RSS reading")
    parser.add_argument("--seconds", type=float, default=900.0, help="stop starting bursts after this long")
    parser.add_argument("--json", type=Path, help="write the row here")
    parser.add_argument("--compare-with", action="append", default=[], metavar="NAME=VALUE",
                        help="first run the bursts with this environment variable set (repeatable), then as is")
    parser.add_argument("--decode-cost", action="store_true",
                        help="measure the decode speed under each oneDNN cache setting instead (CACHE_SETTINGS)")
    parser.add_argument("--repeats", type=int, default=3, help="--decode-cost: runs per setting")
    parser.add_argument("--decode-probe", action="store_true", help=argparse.SUPPRESS)  # one decode_speed run
    options = parser.parse_args()
    if options.decode_probe:
        print(json.dumps(decode_speed()))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if options.decode_cost:
        row = decode_cost(options.repeats)
        text = json.dumps(row, indent=2)
        if options.json is not None:
            options.json.write_text(text + "\n", encoding="utf-8")
        print(text)
        return
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = dict(option.split("=", 1) for option in options.compare_with)
    measure = dict(bursts=options.bursts, streams=options.streams, workers=options.workers,
                   new_tokens=options.new_tokens, settle_s=options.settle, max_seconds=options.seconds)
    if settings:  # the same bursts first under the other settings, then as configured
        before, after = burst_memory(**measure, environment=settings), burst_memory(**measure)
        row = {"benchmark": "burst_memory_comparison", "compared_with": settings, "before": before, "after": after}
    else:
        row = burst_memory(**measure)
    text = json.dumps(row, indent=2)
    if options.json is not None:
        options.json.write_text(text + "\n", encoding="utf-8")
    for part in (row["before"], row["after"]) if settings else (row,):
        print(json.dumps({key: value for key, value in part.items() if key != "rss_mib_per_burst"}, indent=2))


if __name__ == "__main__":
    main()
