"""Throughput where users meet it: one server, one client against `clients` concurrent clients.

The real service (`hypic-rag serve` in a process of its own, on 127.0.0.1; the clients are threads of this process)
over the bundled default model and a corpus it never saw (`foreign_corpus`: 15 invented documents), `/v1/ask`
streamed (top_k 4, `new_tokens` at most: the model's answers end at its stop string, often sooner), asked through
`AskClient`s (the standard library's HTTP/1.1 client, one keep-alive connection per client thread: a load generator
light enough to share the server's cores). First every question is asked alone (the reference answers), then the
closed-loop cells alternate (one client, `clients` clients, one client, ...; `ThroughputConfig.repeats` runs each,
bounded by `max_requests` / `max_seconds`), and every answer a cell got is compared with its question's reference:
`mismatches` counts those that differ (text or sources). The row: requests/s of each cell and their ratio, and each
cell's CPU time of the server's processes (the front and its workers, from /proc): per request, and cores busy;
`cpu_per_request_ratio` is one client's CPU per request over 8 clients' (what batching saves), a figure the other
jobs on a shared machine distort far less than wall time.

    python -m hypic_rag.bench.server_clients --requests 48 --seconds 120 --json out.json
    python -m hypic_rag.bench.server_clients --bare --runs 3 --alternate-workers 1 --json out.json

`--bare` runs the server as `hypic-rag serve` without `--workers` (its own choice of processes and threads);
`--runs N` repeats the row with a new server each time (`--alternate-workers W`: a run with `--workers W` after
each, side by side), and the file then holds every run, the spread of the ratios and the load averages.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hypic_rag.bench.batching import ThroughputConfig, summarize
from hypic_rag.bench.measure import closed_loop

logger = logging.getLogger(__name__)

ONE_CLIENT, CONCURRENT = "one_client", "concurrent"


def server_clients(config: ThroughputConfig, *, clients: int = 8, top_k: int = 4, workers: int | str | None = 1,
                   prefill_wait_s: float | None = None, read_only: bool = False) -> dict[str, Any]:
    """The row (see the module docstring); `config.clients` is not used (the cells are 1 and `clients`). workers:
    the server's `--workers` (model processes behind its endpoint; 1: the single-process server; "auto": its
    rule; None: no `--workers` at all, the bare command); prefill_wait_s: the server's `--prefill-wait` (None: its
    default); read_only: `serve --read-only`."""
    load_before = os.getloadavg()
    from hypic_rag.bench.foreign_corpus import questions

    asked = questions()
    extra = ([] if prefill_wait_s is None else ["--prefill-wait", str(prefill_wait_s)]) + (["--read-only"] if read_only else [])
    with foreign_corpus_server(workers, max(64, 4 * clients), extra) as (url, server):
        local = threading.local()

        def client() -> AskClient:
            if not hasattr(local, "client"):
                local.client = AskClient(url)
            return local.client

        answers: dict[int, tuple[str, tuple[str, ...]]] = {}
        lock = threading.Lock()

        def run_one(number: int) -> tuple[float, int]:
            ttft, tokens, answer = client().ask(asked[number % len(asked)], top_k, config.new_tokens)
            with lock:
                answers[number] = answer
            return ttft, tokens

        reference = {}
        for number, question in enumerate(asked):  # alone: the references (the first one warms up)
            reference[number] = client().ask(question, top_k, config.new_tokens)[2]
        cells: dict[str, list[Any]] = {ONE_CLIENT: [], CONCURRENT: []}
        server_cpu = {ONE_CLIENT: 0.0, CONCURRENT: 0.0}  # CPU seconds of the server's processes in each cell
        per_run = -(-config.max_requests // config.repeats)
        for repeat in range(config.repeats):
            for name, count in ((ONE_CLIENT, 1), (CONCURRENT, clients)):
                before = tree_cpu_seconds(server.pid)
                cells[name].append(closed_loop(run_one, count, per_run, config.max_seconds / config.repeats,
                                               first=(2 * repeat + (name == CONCURRENT)) * per_run))
                server_cpu[name] += cpu_used(before, tree_cpu_seconds(server.pid))
        mismatches = [number for number, answer in answers.items()
                      if answer != reference[number % len(asked)]]
    one = summarize(1, cells[ONE_CLIENT])
    many = summarize(clients, cells[CONCURRENT])
    for cell, name in ((one, ONE_CLIENT), (many, CONCURRENT)):  # CPU-time figures: what load distorts least
        cell["server_cpu_seconds"] = round(server_cpu[name], 3)
        cell["server_cpu_ms_per_request"] = round(1000 * server_cpu[name] / max(cell["completed"], 1), 2)
        cell["server_cores_busy"] = round(server_cpu[name] / cell["seconds"], 3) if cell["seconds"] else 0.0
    ratio = many["requests_per_second"] / one["requests_per_second"] if one["requests_per_second"] else float("nan")
    logger.info("server (%s workers), 1 client %.3f req/s, %d clients %.3f req/s (%.2fx), %d answers differ from alone",
                workers, one["requests_per_second"], clients, many["requests_per_second"], ratio, len(mismatches))
    return {
        "endpoint": f"/v1/ask (streamed, top_k {top_k})", "corpus": "foreign_corpus (15 invented documents)",
        "workers": workers, "read_only": read_only,
        "prefill_wait_s": prefill_wait_s,
        "new_tokens": config.new_tokens, ONE_CLIENT: one, CONCURRENT: many,
        "requests_per_second_ratio": ratio, "answers_compared": len(answers), "mismatches": len(mismatches),
        "cpu_per_request_ratio": round(one["server_cpu_ms_per_request"] / many["server_cpu_ms_per_request"], 3)
        if many["server_cpu_ms_per_request"] else float("nan"),
        "load_average_before": [round(value, 2) for value in load_before],
        "load_average_after": [round(value, 2) for value in os.getloadavg()],
    }


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


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds (user + system, every thread) of `pid` and each process below it, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[member] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15
    return seconds


def cpu_used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes spent between two `tree_cpu_seconds` readings (one that ended meanwhile: lost)."""
    return sum(value - before.get(member, 0.0) for member, value in after.items())


@contextmanager
def foreign_corpus_server(workers: int | str | None, queue_size: int, extra: list[str] | None = None,
                          environment: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """`hypic-rag serve` in a process of its own on 127.0.0.1 over the bundled default model and `foreign_corpus`
    (precomputed into a temporary index), ready: yields (its URL, its process); SIGTERM at the end. workers: its
    `--workers` (None: none given); queue_size: its `--queue-size`; extra: more arguments; environment: variables set for it on top
    of this process's."""
    import httpx

    from hypic_rag.bench.foreign_corpus import write_foreign_corpus
    from hypic_rag.demo.default_model import default_model_path
    from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute
    from hypic_rag.testing import free_port

    with tempfile.TemporaryDirectory(prefix="hypic-bench-server-") as directory:
        corpus = write_foreign_corpus(Path(directory) / "corpus")
        index = Path(directory) / "index"
        precompute(PrecomputeConfig(corpus=corpus, index_dir=index, model_path=default_model_path(), device="cpu",
                                     show_progress=False))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--device", "cpu", "--port", str(port),
             "--queue-size", str(queue_size), "--log-level", "warning",
             *([] if workers is None else ["--workers", str(workers)]), *(extra or [])],
            env={**os.environ, **(environment or {})},
        )
        try:
            _wait_ready(httpx, url, server)
            yield url, server
        finally:
            stop_server(server)


def stop_server(server: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if `server` has not ended within `grace_s` seconds."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        server.kill()


def _wait_ready(httpx: Any, url: str, server: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Until the server's /healthz answers 200 (RuntimeError if its process ended first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout_s:g} s")


class AskClient:
    """One client's keep-alive HTTP/1.1 connection to the server (the standard library's `http.client`: a load
    generator light enough to share the server's cores, as `wrk` or `oha` would be, where httpx costs several ms of
    CPU per streamed request), asking `/v1/ask` streamed. Not thread-safe: one per client thread."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        parsed = urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"an http:// URL is needed, got {url!r}")
        self._connection = http.client.HTTPConnection(parsed.hostname, parsed.port or 80, timeout=timeout_s)

    def ask(self, question: str, top_k: int, new_tokens: int) -> tuple[float, int, tuple[str, tuple[str, ...]]]:
        """Streams `/v1/ask`: (seconds to its first token event, completion tokens, (answer, source chunk ids)).
        RuntimeError for an error status, an error event, or a stream that ends without its done event."""
        body = json.dumps({"question": question, "top_k": top_k, "max_new_tokens": new_tokens, "stream": True})
        began = time.perf_counter()
        try:
            self._connection.request("POST", "/v1/ask", body=body.encode(),
                                     headers={"Content-Type": "application/json"})
            response = self._connection.getresponse()
        except (OSError, http.client.HTTPException):
            self._connection.close()  # a dropped keep-alive connection: the next request opens a new one
            raise
        first = None
        sources: tuple[str, ...] = ()
        try:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
            while line := response.readline():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[len(b"data: "):])
                kind = event.get("type")
                if kind == "sources":
                    sources = tuple(source["chunk_id"] for source in event["sources"])
                elif kind == "token" and first is None:
                    first = time.perf_counter() - began
                elif kind == "done":
                    response.read()  # the rest (the closing chunk): the connection is then reusable
                    elapsed = first if first is not None else time.perf_counter() - began
                    return elapsed, int(event["usage"]["completion_tokens"]), (event["answer"], sources)
                elif kind == "error" or "error" in event:
                    raise RuntimeError(line.decode("utf-8", "replace"))
            raise RuntimeError(f"the stream ended without a done event (status {response.status})")
        except BaseException:
            self._connection.close()  # whatever is left of this response is not read: never reuse the connection
            raise

    def close(self) -> None:
        self._connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48, help="requests per cell (split over the repeats)")
    parser.add_argument("--seconds", type=float, default=120.0, help="wall time per cell")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workers", default="1", help="the server's --workers (model processes, or auto)")
    parser.add_argument("--bare", action="store_true", help="no --workers: the server's own choice (the bare command)")
    parser.add_argument("--runs", type=int, default=1, help="rows, each with a new server (1)")
    parser.add_argument("--alternate-workers", default=None, metavar="W",
                        help="after each run, one with the server's --workers W (side by side, same session)")
    parser.add_argument("--read-only", action="store_true", help="serve --read-only")
    parser.add_argument("--prefill-wait", type=float, default=None, metavar="S",
                        help="the server's --prefill-wait (default: the server's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the row here")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = ThroughputConfig(clients=(1, options.clients), max_requests=options.requests,
                                max_seconds=options.seconds)

    def row(workers: int | str | None) -> dict[str, Any]:
        return server_clients(settings, clients=options.clients, workers=workers, prefill_wait_s=options.prefill_wait,
                              read_only=options.read_only)

    measured = None if options.bare else options.workers
    if options.runs == 1 and options.alternate_workers is None:
        result = row(measured)
    else:
        runs, alternates = [], []
        for _ in range(options.runs):
            runs.append(row(measured))
            if options.alternate_workers is not None:
                alternates.append(row(options.alternate_workers))
        result = {"runs": runs, "ratios": ratio_spread(runs)}
        if alternates:
            result["alternate"] = {"workers": options.alternate_workers, "runs": alternates,
                                   "ratios": ratio_spread(alternates)}
    result = {"command": " ".join(["python -m hypic_rag.bench.server_clients", *sys.argv[1:]]),
              "cpu_cores": len(os.sched_getaffinity(0)), **result}
    text = json.dumps(result, indent=2)
    if options.json is not None:
        options.json.write_text(text + "\n", encoding="utf-8")
    print(text)


def ratio_spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' 8-against-1 ratios (in run order), their minimum, median and maximum, the answers that differed, and
    each run's `cpu_per_request_ratio`."""
    ratios = [run["requests_per_second_ratio"] for run in runs]
    ordered = sorted(ratios)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"each": [round(ratio, 3) for ratio in ratios], "min": round(ordered[0], 3), "median": round(median, 3),
            "max": round(ordered[-1], 3), "mismatches": sum(run["mismatches"] for run in runs),
            "cpu_per_request_ratio": [run.get("cpu_per_request_ratio") for run in runs]}


if __name__ == "__main__":
    main()
