"""The throughput section of `hypic-rag bench`: continuous batching against one request at a time, closed loop.

N clients each send a request, wait for its whole answer, send the next; a cell stops taking new requests after
`max_requests` or `max_seconds` (the requests in flight finish). Per cell: requests/s (completed / elapsed), time
to first token and latency p50 / p95, both measured by the client from sending to the first streamed token (queue
wait included) and to the last. The two ways' runs alternate (`repeats` runs each: one at a time, batched, one at
a time, ...), so that a machine whose speed drifts (shared cores) weighs on both alike. Two ways in:
- `engine_throughput`: the runtime's `Scheduler` on the timing model, RAG k = 8 with warm entries (`hypic`),
  answers of exactly `new_tokens` tokens (end-of-sequence tokens banned): batched (`max_running` = the clients) and
  one at a time (`max_running` = 1: the same code, one sequence per step).
- `server_throughput`: the real service (uvicorn on 127.0.0.1, the bundled default model and example corpus,
  `/v1/ask` streamed, top_k 8, max_new_tokens `new_tokens`: the model's answers end at its stop string, often
  sooner): two servers up side by side, started with `--max-running 16` and `--max-running 1`.
- `modes_throughput`: `hypic`, `prefix` and `full` under the same closed-loop load, batched, on the same engine and
  RAG requests (chunks drawn from a shared pool, so prefix caching hits only where a request's first chunks repeat;
  its chunk-boundary checkpoints warmed by the workload's warm-up requests): requests/s and TTFT p50 / p95 per mode
  and client count, and hypic's ratios against prefix and full.
- `family_throughput`: one row per recurrent mixer kind (`FAMILY_KINDS`: Gated DeltaNet, SSD, selective scan, KDA,
  lightning, short conv), each on its family's random timing model of a published layout (`family_models`, about
  100-200M parameters): `engine_throughput` at one client count (batched against one at a time).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypic_rag.bench import workloads as W
from hypic_rag.bench.family_models import build_family_timing_model
from hypic_rag.bench.measure import percentile, warm_entries
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import HybridModel, wrap_model
from hypic_rag.runtime.modes import check_mode, entry_seams
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

BATCHED, ONE_AT_A_TIME = "batched", "one_at_a_time"

RunOne = Callable[[int], tuple[float, int]]
"""Sends request number n and waits for its answer: (seconds to its first token, completion tokens)."""


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """clients: the closed-loop client counts; max_requests / max_seconds bound each cell (requests started, wall
    time before no new request starts), split over `repeats` runs that alternate with the other way's; new_tokens:
    the answer length; mode: the assembly mode."""

    clients: tuple[int, ...] = (1, 4, 8, 16)
    max_requests: int = 48
    max_seconds: float = 120.0
    new_tokens: int = 16
    mode: str = "hypic"
    repeats: int = 2

    def __post_init__(self) -> None:
        if not self.clients or any(count < 1 for count in self.clients):
            raise ValueError("clients must be positive counts")
        if self.max_requests < 1 or self.max_seconds <= 0 or self.new_tokens < 1 or self.repeats < 1:
            raise ValueError("max_requests, max_seconds, new_tokens and repeats must be positive")
        check_mode(self.mode)


@dataclass(slots=True)
class LoopSamples:
    """What one closed-loop run measured: per completed request its time to first token, latency and completion
    tokens; the failures; the run's wall time."""

    ttfts: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def closed_loop(run_one: RunOne, clients: int, max_requests: int, max_seconds: float, first: int = 0) -> LoopSamples:
    """`clients` threads each sending requests (numbers `first`, `first` + 1, ...) one after the other until
    `max_requests` were started or `max_seconds` passed."""
    lock = threading.Lock()
    samples = LoopSamples()
    started = [0]
    began = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                if started[0] >= max_requests or time.perf_counter() - began > max_seconds:
                    return
                number = first + started[0]
                started[0] += 1
            sent = time.perf_counter()
            try:
                ttft, completion = run_one(number)
            except Exception as error:  # reported in the cell, not raised: a cell measures what completed
                logger.warning("request %d failed: %s", number, error)
                with lock:
                    samples.errors.append(f"{type(error).__name__}: {error}")
                continue
            with lock:
                samples.ttfts.append(ttft)
                samples.latencies.append(time.perf_counter() - sent)
                samples.tokens.append(completion)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max_seconds + 1200)
    samples.seconds = time.perf_counter() - began
    return samples


def summarize(clients: int, parts: Sequence[LoopSamples]) -> dict[str, Any]:
    """One cell from its interleaved runs: requests/s (completed over their summed wall time), TTFT and latency
    percentiles over every request."""
    ttfts = [value for part in parts for value in part.ttfts]
    latencies = [value for part in parts for value in part.latencies]
    tokens = [value for part in parts for value in part.tokens]
    errors = [value for part in parts for value in part.errors]
    seconds = sum(part.seconds for part in parts)
    return {
        "clients": clients,
        "runs": len(parts),
        "completed": len(latencies),
        "failed": len(errors),
        "errors": errors[:3],
        "seconds": seconds,
        "requests_per_second": len(latencies) / seconds if seconds > 0 else 0.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p95": percentile(ttfts, 95),
        "latency_p50": percentile(latencies, 50),
        "latency_p95": percentile(latencies, 95),
        "mean_completion_tokens": sum(tokens) / len(tokens) if tokens else 0.0,
    }


def interleaved(ways: dict[str, RunOne], clients: int, config: ThroughputConfig) -> dict[str, dict[str, Any]]:
    """Each way's cell at `clients`, its `repeats` runs alternating with the other way's (one, batched, one, ...),
    so that a machine whose speed drifts (shared cores) weighs on both alike."""
    parts: dict[str, list[LoopSamples]] = {way: [] for way in ways}
    per_run = -(-config.max_requests // config.repeats)
    for repeat in range(config.repeats):
        for way, run_one in ways.items():
            parts[way].append(closed_loop(run_one, clients, per_run, config.max_seconds / config.repeats,
                                          first=repeat * per_run))
    return {way: summarize(clients, runs) for way, runs in parts.items()}


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


def _answer_params(model: HybridModel, config: ThroughputConfig) -> SamplingParams:
    """Answers of exactly `new_tokens` tokens: greedy, end-of-sequence tokens banned."""
    return SamplingParams(max_new_tokens=config.new_tokens, logit_bias={token: -100.0 for token in model.eos_token_ids})


def _runner(scheduler: Scheduler, requests: Sequence[Request], mode: str, params: SamplingParams) -> RunOne:
    """Request number n (of `requests`, round robin) streamed through `scheduler` under `mode`."""
    return lambda number: _stream_timed(scheduler.stream(requests[number % len(requests)], mode, params))


def _scheduler(engine: Engine, running: int) -> Scheduler:
    """A started scheduler of `engine` running at most `running` sequences at once."""
    return Scheduler(engine, SchedulerConfig(max_running=running, step_tokens=max(2048, running),
                                             max_waiting=None)).start()


def engine_throughput(
    model: HybridModel, requests: Sequence[Request], config: ThroughputConfig, *, seam_tokens: int,
    show_progress: bool = False,
) -> dict[str, Any]:
    """Both ways on one engine with warm entries (precomputed for `requests`); see the module docstring."""
    engine = Engine(model, seam_tokens=seam_tokens)
    warm_entries(engine, requests, entry_seams([config.mode], seam_tokens), show_progress)
    params = _answer_params(model, config)
    cells: dict[str, list[dict[str, Any]]] = {BATCHED: [], ONE_AT_A_TIME: []}

    for clients in config.clients:
        schedulers = {ONE_AT_A_TIME: 1, BATCHED: clients}
        started = {name: _scheduler(engine, running) for name, running in schedulers.items()}
        try:
            ways = {name: _runner(scheduler, requests, config.mode, params) for name, scheduler in started.items()}
            for run_one in ways.values():
                run_one(0)  # warm-up (lazy initialisation), not counted
            measured = interleaved(ways, clients, config)  # one way at a time: the engine is never shared at once
        finally:
            for scheduler in started.values():
                scheduler.stop()
        for name, cell in measured.items():
            cell["max_running"] = schedulers[name]
            logger.info("engine %s, %d clients: %.3f req/s, TTFT p50 %.3f s", name, clients,
                        cell["requests_per_second"], cell["ttft_p50"])
            cells[name].append(cell)
    return {"mode": config.mode, "new_tokens": config.new_tokens, "requests": len(requests), **cells,
            "comparison": compare(cells)}


THROUGHPUT_MODES = ("hypic", "prefix", "full")
"""The modes `modes_throughput` compares (HYPIC's headline: QPS and TTFT against prefix caching)."""


def modes_throughput(
    model: HybridModel, workload: W.Workload, config: ThroughputConfig, *, seam_tokens: int,
    modes: Sequence[str] = THROUGHPUT_MODES, show_progress: bool = False,
) -> dict[str, Any]:
    """`modes` under the same closed-loop load, batched (`max_running` = the clients), on one engine: entries warm
    for the composing modes, prefix mode's checkpoints warmed by `workload.warmup` (so it reuses what earlier
    requests left, as a prefix cache would). Per mode a cell per client count, their runs alternating with the other
    modes'; `comparison`: hypic's requests/s and TTFT p50 against each other mode's."""
    for mode in modes:
        check_mode(mode)
    engine = Engine(model, seam_tokens=seam_tokens)
    requests = workload.requests
    warm_entries(engine, [*requests, *workload.warmup], entry_seams(modes, seam_tokens), show_progress)
    if "prefix" in modes:
        for request in workload.warmup:  # chunk-boundary checkpoints from other requests
            engine.prefill(request, "prefix")
    params = _answer_params(model, config)
    cells: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for clients in config.clients:
        scheduler = _scheduler(engine, clients)
        try:
            ways = {mode: _runner(scheduler, requests, mode, params) for mode in modes}
            for run_one in ways.values():
                run_one(0)  # warm-up, not counted
            measured = interleaved(ways, clients, config)
        finally:
            scheduler.stop()
        for mode, cell in measured.items():
            cell["max_running"] = clients
            logger.info("%s, %d clients: %.3f req/s, TTFT p50 %.3f s", mode, clients, cell["requests_per_second"],
                        cell["ttft_p50"])
            cells[mode].append(cell)
    comparison = []
    if "hypic" in modes:
        for index, clients in enumerate(config.clients):
            hypic = cells["hypic"][index]
            row: dict[str, Any] = {"clients": clients}
            for mode in modes:
                if mode == "hypic":
                    continue
                other = cells[mode][index]
                row[f"requests_per_second_vs_{mode}"] = (
                    hypic["requests_per_second"] / other["requests_per_second"]
                    if other["requests_per_second"] else float("nan")
                )
                row[f"ttft_p50_vs_{mode}"] = other["ttft_p50"] / hypic["ttft_p50"] if hypic["ttft_p50"] else float("nan")
            comparison.append(row)
    return {"new_tokens": config.new_tokens, "requests": len(requests), "modes": cells, "comparison": comparison}


FAMILY_KINDS: dict[str, str] = {
    "qwen3_5": "Gated DeltaNet",
    "granitemoehybrid": "SSD (Mamba2)",
    "jamba": "selective scan (Mamba1)",
    "kimi_linear": "KDA",
    "minimax": "lightning attention",
    "lfm2": "short conv",
}
"""One family per recurrent mixer kind, for `family_throughput` (each with attention layers too)."""


def family_throughput(
    families: Sequence[str], config: ThroughputConfig, *, chunk_tokens: int, pool_size: int, seam_tokens: int,
    tiny: bool = False, seed: int = 0, show_progress: bool = False,
) -> dict[str, Any]:
    """Per family: its random timing model (`family_models.build_family_timing_model`; `tiny`: the test suite's
    tiny model), RAG k = 8 requests of `chunk_tokens`-token chunks from a pool of `pool_size`, `engine_throughput`
    at `config.clients` (batched against one at a time, `hypic`). Each model is built, measured and dropped in
    turn."""
    rows = []
    for model_type in families:
        if model_type not in FAMILY_KINDS:
            raise ValueError(f"no mixer kind recorded for {model_type!r}; choose among {', '.join(FAMILY_KINDS)}")
        began = time.perf_counter()
        hf_model = build_family_timing_model(model_type, seed=seed, tiny=tiny)
        parameters = sum(parameter.numel() for parameter in hf_model.parameters())
        tokens = W.TokenSource(hf_model.config.get_text_config().vocab_size, seed)
        workload = W.rag_qa(tokens, top_k=8, pool_size=pool_size, chunk_tokens=chunk_tokens,
                            requests=max(16, config.max_requests), warmup=0)
        logger.info("throughput: %s (%s), %.0fM parameters", model_type, FAMILY_KINDS[model_type], parameters / 1e6)
        measured = engine_throughput(wrap_model(hf_model), workload.requests, config, seam_tokens=seam_tokens,
                                     show_progress=show_progress)
        del hf_model
        rows.append({"model_type": model_type, "mixer": FAMILY_KINDS[model_type], "parameters": parameters,
                     "tiny": tiny, **measured, "seconds": time.perf_counter() - began})
    return {"chunk_tokens": chunk_tokens, "rows": rows}


def server_throughput(config: ThroughputConfig, *, max_running: int = 16) -> dict[str, Any]:
    """Both ways through the real service over the bundled model and example corpus (an index built in a temporary
    directory first); see the module docstring."""
    import httpx

    from hypic_rag.demo.default_model import default_model_path, example_corpus_path
    from hypic_rag.demo.example_corpus import read_questions
    from hypic_rag.pipeline.precompute import PrecomputeOptions, precompute
    from hypic_rag.server import ServerConfig
    from hypic_rag.server.runner import ServerThread

    questions = [question.text for question in read_questions()]
    cells: dict[str, list[dict[str, Any]]] = {BATCHED: [], ONE_AT_A_TIME: []}
    limits = {ONE_AT_A_TIME: 1, BATCHED: max_running}
    with tempfile.TemporaryDirectory(prefix="hypic-bench-server-") as directory:
        built = Path(directory) / "index"
        precompute(PrecomputeOptions(corpus=example_corpus_path() / "documents", index_dir=built,
                                     model_path=default_model_path(), device="cpu", show_progress=False))
        servers: dict[str, ServerThread] = {}
        clients: dict[str, httpx.Client] = {}
        try:
            for name, running in limits.items():  # both up at once (each on its own copy of the index)
                index = Path(shutil.copytree(built, Path(directory) / name))
                server_config = ServerConfig(index_dir=index, device="cpu", max_running=running,
                                             queue_size=max(64, 2 * max(config.clients)))
                servers[name] = ServerThread(server_config).start()
                clients[name] = httpx.Client(base_url=servers[name].url, timeout=600)
            ways = {name: _asker(http, questions, config.new_tokens) for name, http in clients.items()}
            for run_one in ways.values():
                run_one(0)  # warm-up
            for count in config.clients:
                for name, cell in interleaved(ways, count, config).items():
                    cell["max_running"] = limits[name]
                    logger.info("server %s, %d clients: %.3f req/s, TTFT p50 %.3f s", name, count,
                                cell["requests_per_second"], cell["ttft_p50"])
                    cells[name].append(cell)
        finally:
            for http in clients.values():
                http.close()
            for server in servers.values():
                server.stop()
    return {"endpoint": "/v1/ask (streamed, top_k 8)", "new_tokens": config.new_tokens, **cells,
            "comparison": compare(cells)}


def _asker(http: Any, questions: list[str], new_tokens: int) -> RunOne:
    """Streams `/v1/ask` for question number n: (seconds to its first token event, completion tokens)."""

    def run_one(number: int) -> tuple[float, int]:
        body = {"question": questions[number % len(questions)], "top_k": 8, "max_new_tokens": new_tokens,
                "stream": True}
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

    return run_one
