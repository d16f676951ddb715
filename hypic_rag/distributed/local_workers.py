"""The workers of `hypic-rag serve --workers N` (and of the bare `serve` on a CPU with a small model): N model
processes on this host behind one endpoint, no Ray.

Each worker is a process of its own (multiprocessing, spawned) that runs the single-process service
(`create_app` over the index, as a replica: `ServerConfig.for_replica`) on a private Unix socket; the front
(`front.Front`, in the serving process) forwards every request whole to the worker with the fewest requests in
flight and streams its response back. So the model work of N workers runs on N cores at once, each worker with its
own Python interpreter (no GIL shared) and `cores // N` intra-op threads: on a CPU host whose per-step work is many
small operations, one model worker thread is the limit that batching alone does not lift (docs/service.md,
"Workers").

    workers = LocalWorkers(config, count=2).start()   # loads the model in every worker; raises if one fails
    front = Front(config, workers.clients, retrieve=None, owner=workers.owner)
    ...
    workers.stop()

Writes: over a writable index (`config.read_only` False) worker-0 is the index's **owner**: it opens the index as
its writer (the index's lock, the docstore, the FAISS file, the manifest) and the front sends it every document
route (`front.owner_route`: adding, deleting, listing documents, job status); the others open the index for
search and follow the owner's commits before each retrieval (`CorpusIndex.follow_writer`), so a document the owner
has indexed is found by every worker from then on. Every worker answers questions, the owner included, but while
the owner has document jobs pending the front sends questions to the others as long as one has room (the owner's
model worker steps a job only between questions: `front.Front.owner_busy`). Segment cache entries are written by
whichever worker encodes them: each put is an LMDB write transaction, serialised across the processes by LMDB's
own lock, and one killed mid-transaction leaves nothing of it (lmdb_store.py).
Over a read-only index every worker is a reader and document routes answer 409.

Unlike Ray replicas, the front does not retrieve to route `/v1/ask` (the workers share the host's LMDB segment
cache, and a retrieval in the front would embed every question twice on the same cores): it routes by load, and
completions by their segments' digests (`front.Front.affinity_keys`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart
from hypic_rag.distributed.front import ReplicaStartError
from hypic_rag.distributed.rendezvous import RendezvousRouter
from hypic_rag.distributed.unix_http import UnixHttpPool
from hypic_rag.errors import HypicError
from hypic_rag.server import ServerConfig

logger = logging.getLogger(__name__)

WORKER_PREFIX = "worker-"
READY = "ready"
STOP_GRACE_S = 5.0
"""Seconds a worker gets after its shutdown grace (SIGTERM) before it is killed."""


def worker_names(count: int) -> list[str]:
    return [f"{WORKER_PREFIX}{number}" for number in range(count)]


def worker_threads(count: int, cores: int | None = None) -> int:
    """Intra-op threads of each of `count` workers: the host's cores shared out, at least one each."""
    cores = cores if cores is not None else host_cores()
    return max(1, cores // count)


SMALL_MODEL_BYTES = 64 << 20
"""Weights up to this size (the bundled model: ~9 MB) make `auto_workers` run one worker per core: a step of such
a model is thousands of small operations run by one Python thread, so only processes use a second core. Larger
models are matrix-bound: one process, batching, with every core's threads."""

MAX_AUTO_WORKERS = 8
"""The most workers `auto_workers` starts (each holds a copy of the model and its own retrieval stage)."""


def host_cores() -> int:
    """The cores this process may run on (its affinity set)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def weight_bytes(model_path: Path) -> int:
    """Bytes of the checkpoint's weight files (`*.safetensors`, `*.bin`) in `model_path` (0 if none are found)."""
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in model_path.glob(pattern))


def auto_workers(cores: int, model_bytes: int, *, device: str | None) -> int:
    """`serve` without `--workers` (or `--workers auto`): the model processes to start. One per core (at most
    `MAX_AUTO_WORKERS`) on a CPU with at least 2 cores when the weights are at most `SMALL_MODEL_BYTES`; otherwise
    1 (a larger model: one process batching with every core's threads; on a GPU: one process per device). Readable
    and writable indexes alike: over a writable one worker-0 owns the index and the others follow its writes."""
    if cores < 2 or model_bytes > SMALL_MODEL_BYTES or (device or "cpu") != "cpu":
        return 1
    return min(cores, MAX_AUTO_WORKERS)


def layout_reason(workers: int, threads: int, cores: int, model_bytes: int, device: str, *, chosen: bool) -> str:
    """One line saying what `serve` runs and why (`chosen`: by `auto_workers`, else by --workers / --threads)."""
    shape = f"{workers} worker process{'es' if workers > 1 else ''} x {threads} intra-op thread{'s' * (threads > 1)}"
    facts = f"{cores} cores this process may use, {model_bytes / 1e6:.1f} MB of weights, {device}"
    if not chosen:
        return f"{shape} ({facts}; set by --workers / --threads)"
    if workers > 1:
        why = (f"weights <= {SMALL_MODEL_BYTES >> 20} MiB on a CPU: a small model's step is Python-bound, so one "
               "process per core")
    elif (device or "cpu") != "cpu":
        why = "one process per device"
    elif cores < 2:
        why = "one core"
    else:
        why = f"weights > {SMALL_MODEL_BYTES >> 20} MiB: a matrix-bound model, one process batching on every core"
    return f"{shape} ({facts}: {why}; --workers N / --threads N override)"


def run_worker(config: ServerConfig, name: str, socket_path: str, threads: int, log_level: str,
               ready: Connection) -> None:
    """A worker process's body: open the service as `config` says (the replica's: `ServerConfig.for_replica`;
    model, index, cache), listen on `socket_path`, say `READY` (or the start-up error, one line) on `ready`, then
    serve until SIGTERM or SIGINT."""
    import torch
    import uvicorn

    os.setsid()  # a terminal's Ctrl-C reaches the front alone, which then stops the workers (no restart race)
    logging.basicConfig(level=getattr(logging, log_level.upper()), format=f"%(levelname)s [{name}] %(message)s")
    logging.getLogger("hypic_rag").setLevel(getattr(logging, log_level.upper()))
    torch.set_num_threads(threads)
    try:
        from hypic_rag.server import create_app

        app = create_app(config, start=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(socket_path)
        listener.listen(1024)  # connections wait in the backlog until uvicorn accepts them
    except BaseException as error:  # noqa: BLE001 - reported to the parent as one line, then this process ends
        code = error.exit_code if isinstance(error, HypicError) else 1  # 3: an index built for another model, ...
        ready.send((code, " ".join(f"{type(error).__name__}: {error}".split())))  # one line, whatever the message
        ready.close()
        raise SystemExit(1) from None
    ready.send(READY)
    ready.close()
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)),
        access_log=log_level == "debug",
    ))
    server.run(sockets=[listener])


def _accepts(socket_path: str) -> bool:
    """Whether a worker's Unix socket accepts a connection now."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(socket_path)
        except OSError:
            return False
    return True


class WorkerClient:
    """A `front.ReplicaClient` over one worker's Unix socket: HTTP/1.1 on a pool of keep-alive connections
    (`unix_http.UnixHttpPool`, which says when `ReplicaUnreachable` is raised)."""

    def __init__(self, name: str, socket_path: str, max_connections: int = 256) -> None:
        self.name = name
        self.socket_path = socket_path
        self._pool = UnixHttpPool(socket_path, name=name, max_idle=max_connections)

    def stream(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The worker's response to `request`: a `ResponseStart`, then the body's parts as the worker sends them;
        `ReplicaUnreachable` when the worker cannot be reached or drops the connection before its response starts
        (it died: the front may send the request to another worker). Closing the iteration early closes the
        connection: the worker sees its client go away."""
        return self._pool.stream(request)


class LocalWorkers:
    """`count` worker processes over `config`'s index (see the module docstring); `clients` are their front
    clients, by worker name; `owner` the worker that writes a writable index (None when it is served read-only).
    A worker that dies while serving is restarted by `watch` (`serve --workers` runs it)."""

    def __init__(self, config: ServerConfig, count: int, *, threads: int | None = None,
                 log_level: str = "warning") -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.config = config
        self.count = count
        self.threads = threads if threads is not None else worker_threads(count)
        self.log_level = log_level
        self._directory = tempfile.mkdtemp(prefix="hypic-workers-")
        self._context = multiprocessing.get_context("spawn")  # no fork of a process holding threads and the cache
        self._processes: dict[str, Any] = {}
        self.restarts = 0
        self.owner: str | None = None if config.read_only else worker_names(count)[0]
        self.clients: dict[str, WorkerClient] = {
            name: WorkerClient(name, str(Path(self._directory) / f"{name}.sock")) for name in worker_names(count)}

    def start(self) -> LocalWorkers:
        """Start every worker and wait until all have loaded (they load in parallel); `ReplicaStartError` naming
        the first that failed, after stopping the others."""
        try:
            waiting = {name: self._spawn(name) for name in self.clients}
            for name, ready in waiting.items():
                self._await_ready(name, ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str) -> Connection:
        path = self.clients[name].socket_path
        if os.path.exists(path):
            os.unlink(path)
        receive, send = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=run_worker, name=f"hypic-{name}", daemon=False,
            args=(self.config.for_replica(name, owner=name == self.owner), name, path, self.threads, self.log_level,
                  send),
        )
        process.start()
        send.close()
        self._processes[name] = process
        return receive

    def _await_ready(self, name: str, ready: Connection) -> None:
        process = self._processes[name]
        deadline = time.monotonic() + self.config.startup_timeout_s
        try:
            while not ready.poll(0.2):
                if not process.is_alive():
                    raise ReplicaStartError(f"{name} exited with code {process.exitcode} while loading")
                if time.monotonic() > deadline:
                    raise ReplicaStartError(f"{name} did not load within {self.config.startup_timeout_s:g} s")
            try:
                message = ready.recv()
            except EOFError:
                raise ReplicaStartError(f"{name} exited while loading") from None
        finally:
            ready.close()
        if message != READY:
            code, line = message
            failure = ReplicaStartError(f"{name} could not start: {line}")
            failure.exit_code = code  # the command exits as the single server would for the same error
            raise failure
        logger.info("%s ready (pid %d, %d intra-op threads%s)", name, process.pid, self.threads,
                    ", owns the index" if name == self.owner else "")

    def alive(self) -> dict[str, bool]:
        return {name: process.is_alive() for name, process in self._processes.items()}

    def watch(self, stopping: threading.Event, period_s: float = 1.0, router: RendezvousRouter | None = None) -> None:
        """Restart any worker that died (a crash, the OOM killer) until `stopping` is set. Its death is seen at once
        (the process's sentinel wakes the watch) and it is taken out of `router`'s rotation then, so new requests
        go to the others; it returns to the rotation once restarted. Its requests in flight failed with it."""
        while not stopping.is_set():
            multiprocessing.connection.wait([process.sentinel for process in self._processes.values()], period_s)
            for name, alive in self.alive().items():
                if stopping.is_set():
                    return
                if alive:
                    if router is not None and router.is_down(name) and _accepts(self.clients[name].socket_path):
                        router.mark_up(name)  # it was unreachable for a moment, and answers again
                    continue
                exit_code = self._processes[name].exitcode
                if router is not None:
                    router.mark_down(name, f"its process exited with code {exit_code}")
                logger.error("%s died (exit code %s); restarting it", name, exit_code)
                self.restarts += 1
                try:
                    self._await_ready(name, self._spawn(name))
                except ReplicaStartError as error:
                    logger.error("%s", error)
                    stopping.wait(period_s)  # not a restart loop at full speed
                    continue
                if router is not None:
                    router.mark_up(name)

    @contextmanager
    def watching(self, period_s: float = 1.0, router: RendezvousRouter | None = None) -> Iterator[None]:
        """`watch` in a thread of its own for the block."""
        stopping = threading.Event()
        thread = threading.Thread(target=self.watch, args=(stopping, period_s, router), name="hypic-workers-watch",
                                  daemon=True)
        thread.start()
        try:
            yield
        finally:
            stopping.set()
            thread.join(self.config.startup_timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every worker (each finishes its requests in flight within the shutdown grace, then closes its
        cache), SIGKILL what is left after the grace."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        for process in self._processes.values():
            if process.is_alive() and process.pid is not None:
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s + STOP_GRACE_S
        for name, process in self._processes.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("%s did not stop within the grace; killing it", name)
                process.kill()
                process.join(5.0)
        for client in self.clients.values():
            if os.path.exists(client.socket_path):
                os.unlink(client.socket_path)
        try:
            os.rmdir(self._directory)
        except OSError:
            pass

    def __enter__(self) -> LocalWorkers:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

