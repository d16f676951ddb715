"""The throughput section of `hypic-rag bench`: continuous batching against one request at a time, closed loop.

N clients each send a request, wait for its whole answer, send the next; a cell stops taking new requests after
`max_requests` or `max_seconds` (the requests in flight finish). Per cell: requests/s (completed / elapsed), time
to first token and latency p50 / p95, both measured by the client from sending to the first streamed token (queue
wait included) and to the last. Two ways in:
- `engine_throughput`: the runtime's `Scheduler` on the timing model, RAG k = 8 with warm entries (`hypic`),
  answers of exactly `new_tokens` tokens (end-of-sequence tokens banned): batched (`max_running` = the clients) and
  one at a time (`max_running` = 1: the same code, one sequence per step).
- `server_throughput`: the real service (uvicorn on 127.0.0.1, the bundled default model and example corpus,
  `/v1/ask` streamed, top_k 8, max_new_tokens `new_tokens`: the model's answers end at its stop string, often
  sooner), started with `--max-running 16` and `--max-running 1`.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypic_rag.bench.measure import percentile, warm_entries
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import entry_seams
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

BATCHED, ONE_AT_A_TIME = "batched", "one_at_a_time"

RunOne = Callable[[int], tuple[float, int]]
"""Sends request number n and waits for its answer: (seconds to its first token, completion tokens)."""


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """clients: the closed-loop client counts; max_requests / max_seconds bound each cell (requests started, wall
    time before no new request starts); new_tokens: the answer length; mode: the assembly mode."""

    clients: tuple[int, ...] = (1, 4, 8, 16)
    max_requests: int = 48
    max_seconds: float = 120.0
    new_tokens: int = 16
    mode: str = "hypic"

    def __post_init__(self) -> None:
        if not self.clients or any(count < 1 for count in self.clients):
            raise ValueError("clients must be positive counts")
        if self.max_requests < 1 or self.max_seconds <= 0 or self.new_tokens < 1:
            raise ValueError("max_requests, max_seconds and new_tokens must be positive")


def closed_loop(run_one: RunOne, clients: int, max_requests: int, max_seconds: float) -> dict[str, Any]:
    """`clients` threads each sending requests (numbers 0, 1, ...) one after the other until `max_requests` were
    started or `max_seconds` passed; requests/s, time to first token and latency percentiles of the cell."""
    lock = threading.Lock()
    ttfts: list[float] = []
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    started = [0]
    began = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                if started[0] >= max_requests or time.perf_counter() - began > max_seconds:
                    return
                number = started[0]
                started[0] += 1
            sent = time.perf_counter()
            try:
                ttft, completion = run_one(number)
            except Exception as error:  # reported in the cell, not raised: a cell measures what completed
                logger.warning("request %d failed: %s", number, error)
                with lock:
                    errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                ttfts.append(ttft)
                latencies.append(time.perf_counter() - sent)
                tokens.append(completion)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max_seconds + 1200)
    elapsed = time.perf_counter() - began
    return {
        "clients": clients,
        "completed": len(latencies),
        "failed": len(errors),
        "errors": errors[:3],
        "seconds": elapsed,
        "requests_per_second": len(latencies) / elapsed if elapsed > 0 else 0.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p95": percentile(ttfts, 95),
        "latency_p50": percentile(latencies, 50),
        "latency_p95": percentile(latencies, 95),
        "mean_completion_tokens": sum(tokens) / len(tokens) if tokens else 0.0,
    }


def compare(cells: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per client count: batched / one-at-a-time requests/s and one-at-a-time / batched TTFT p50."""
    rows = []
    for batched, alone in zip(cells[BATCHED], cells[ONE_AT_A_TIME], strict=True):
        rows.append({
            "clients": batched["clients"],
            "requests_per_second_ratio": batched["requests_per_second"] / alone["requests_per_second"]
            if alone["requests_per_second"] else float("nan"),
            "ttft_p50_ratio": alone["ttft_p50"] / batched["ttft_p50"] if batched["ttft_p50"] else float("nan"),
        })
    return rows


def _stream_timed(stream: Any) -> tuple[float, int]:
    """Iterate a `GenerationStream`: (seconds to its first item, tokens generated)."""
    began = time.perf_counter()
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - began
    generation = stream.result
    return (first if first is not None else time.perf_counter() - began), len(generation.token_ids)


def engine_throughput(
    model: HybridModel, requests: Sequence[Request], config: ThroughputConfig, *, seam_tokens: int,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Both ways on one engine with warm entries (precomputed for `requests`); see the module docstring."""
    engine = Engine(model, seam_tokens=seam_tokens)
    warm_entries(engine, requests, entry_seams([config.mode], seam_tokens), show_progress)
    params = SamplingParams(max_new_tokens=config.new_tokens,
                            logit_bias={token: -100.0 for token in model.eos_token_ids})
    cells: dict[str, list[dict[str, Any]]] = {BATCHED: [], ONE_AT_A_TIME: []}
    for clients in config.clients:
        for way in (ONE_AT_A_TIME, BATCHED):
            running = clients if way == BATCHED else 1
            scheduler = Scheduler(engine, SchedulerConfig(max_running=running, step_tokens=max(2048, running),
                                                          max_waiting=None)).start()
            try:
                def run_one(number: int) -> tuple[float, int]:
                    request = requests[number % len(requests)]
                    return _stream_timed(scheduler.stream(request, config.mode, params))

                run_one(0)  # warm-up (lazy initialisation), not counted
                cell = closed_loop(run_one, clients, config.max_requests, config.max_seconds)
            finally:
                scheduler.stop()
            cell["max_running"] = running
            logger.info("engine %s, %d clients: %.3f req/s, TTFT p50 %.3f s", way, clients,
                        cell["requests_per_second"], cell["ttft_p50"])
            cells[way].append(cell)
    return {"mode": config.mode, "new_tokens": config.new_tokens, "requests": len(requests), **cells,
            "comparison": compare(cells)}


def server_throughput(config: ThroughputConfig, *, max_running: int = 16) -> dict[str, Any]:
    """Both ways through the real service over the bundled model and example corpus (an index built in a temporary
    directory first); see the module docstring."""
    import httpx

    from hypic_rag.default_model import default_model_path, example_corpus_path
    from hypic_rag.example_corpus import read_questions
    from hypic_rag.retrieval.precompute import PrecomputeOptions, precompute
    from hypic_rag.server import ServerConfig
    from hypic_rag.server.runner import ServerThread

    questions = [question.text for question in read_questions()]
    cells: dict[str, list[dict[str, Any]]] = {BATCHED: [], ONE_AT_A_TIME: []}
    with tempfile.TemporaryDirectory(prefix="hypic-bench-server-") as directory:
        index = Path(directory) / "index"
        precompute(PrecomputeOptions(corpus=example_corpus_path() / "documents", index_dir=index,
                                     model_path=default_model_path(), device="cpu", show_progress=False))
        for way in (ONE_AT_A_TIME, BATCHED):
            running = max_running if way == BATCHED else 1
            server_config = ServerConfig(index_dir=index, device="cpu", max_running=running,
                                         queue_size=max(64, 2 * max(config.clients)))
            with ServerThread(server_config) as server, httpx.Client(base_url=server.url, timeout=600) as http:

                def run_one(number: int) -> tuple[float, int]:
                    body = {"question": questions[number % len(questions)], "top_k": 8,
                            "max_new_tokens": config.new_tokens, "stream": True}
                    began = time.perf_counter()
                    first = None
                    with http.stream("POST", "/v1/ask", json=body) as response:
                        for line in response.iter_lines():
                            if first is None and line.startswith('data: {"type":"token"'):
                                first = time.perf_counter() - began
                            if line.startswith('data: {"type":"done"'):
                                usage = json.loads(line[len("data: "):])["usage"]
                                return (first if first is not None else time.perf_counter() - began,
                                        int(usage["completion_tokens"]))
                            if line.startswith('data: {"type":"error"'):
                                raise RuntimeError(line)
                    raise RuntimeError(f"the stream ended without a done event (status {response.status_code})")

                run_one(0)  # warm-up
                for clients in config.clients:
                    cell = closed_loop(run_one, clients, config.max_requests, config.max_seconds)
                    cell["max_running"] = running
                    logger.info("server %s, %d clients: %.3f req/s, TTFT p50 %.3f s", way, clients,
                                cell["requests_per_second"], cell["ttft_p50"])
                    cells[way].append(cell)
    return {"endpoint": "/v1/ask (streamed, top_k 8)", "new_tokens": config.new_tokens, **cells,
            "comparison": compare(cells)}
