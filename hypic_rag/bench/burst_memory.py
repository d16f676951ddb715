"""Reliability under repeated bursts: the resident memory of the service's processes, burst after burst.

The real service (`hypic-rag serve`, a process of its own on 127.0.0.1, `--workers N` model processes behind its
endpoint, or the single-process server with 1) over the bundled default model and a corpus it never saw
(`foreign_corpus`). Each burst opens `streams` streamed `/v1/ask` requests at once; every other one is abandoned
after its first event (the client closes the connection), the rest are read to their end and compared with the
answer the same question got alone. After each burst, once the server is idle again (`settle_s`), the resident
set (VmRSS) of the server's process and of each process below it is read from /proc. The row: RSS per process per
burst (MiB), the growth of the largest worker from the first burst to the last and over the last half, the answers
that differed, and the malloc settings of the run (`MALLOC_ARENA_MAX` from the environment, inherited by the
server).

    python -m hypic_rag.bench.burst_memory --bursts 20 --streams 64 --workers 2 --json out.json
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


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (children of any of its threads, recursively), parents first."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop(0)
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            pending.extend(int(child) for child in children if int(child) not in found)
    return found


def rss_mib(pid: int) -> float | None:
    """The resident set of process `pid` in MiB (VmRSS), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
    except OSError:
        return None
    return None


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
                 settle_s: float = 2.0, max_seconds: float = 900.0) -> dict[str, Any]:
    """The row (see the module docstring). Stops early (`stopped_early`) past `max_seconds` of bursts."""
    import httpx

    from hypic_rag.bench.foreign_corpus import questions
    from hypic_rag.bench.server_clients import _ask, foreign_corpus_server

    asked = questions()
    rows: list[dict[str, Any]] = []
    differing = failed_streams = 0
    began = time.monotonic()
    with foreign_corpus_server(workers, max(256, 4 * streams)) as (url, server):
        with httpx.Client(base_url=url, timeout=600) as http:
            reference = [_ask(http, question, top_k, new_tokens)[2][0] for question in asked]
        time.sleep(settle_s)
        rows.append({"burst": 0, "rss_mib": {str(pid): rss_mib(pid) for pid in process_tree(server.pid)}})
        for burst in range(1, bursts + 1):
            if time.monotonic() - began > max_seconds:
                break
            answers, failed = asyncio.run(_burst(url, asked, streams, top_k, new_tokens, first=burst * streams))
            failed_streams += failed
            differing += sum(answer != reference[number % len(asked)] for number, answer in answers.items())
            time.sleep(settle_s)
            tree = process_tree(server.pid)
            rows.append({"burst": burst, "rss_mib": {str(pid): rss_mib(pid) for pid in tree}})
            logger.info("burst %d: RSS %s MiB", burst, ", ".join(f"{rss_mib(pid) or 0:.0f}" for pid in tree))
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
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "front_pid": front,
        "rss_mib_per_burst": rows,
        "largest_process_mib": [round(largest(row), 1) for row in rows],
        "growth_mib_first_to_last": round(largest(rows[-1]) - largest(rows[1 if len(rows) > 1 else 0]), 1),
        "growth_mib_last_half": round(largest(rows[-1]) - largest(half), 1),
        "answers_differing_from_alone": differing,
        "failed_streams": failed_streams,
        "seconds": round(time.monotonic() - began, 1),
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
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    row = burst_memory(bursts=options.bursts, streams=options.streams, workers=options.workers,
                       new_tokens=options.new_tokens, settle_s=options.settle, max_seconds=options.seconds)
    text = json.dumps(row, indent=2)
    if options.json is not None:
        options.json.write_text(text + "\n", encoding="utf-8")
    print(json.dumps({key: value for key, value in row.items() if key != "rss_mib_per_burst"}, indent=2))


if __name__ == "__main__":
    main()
