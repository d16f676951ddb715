"""Running `hypic-rag serve --replicas N` (replicas on Ray Serve) and `serve --workers N` (worker processes on this
host, `local_workers.py`), the front on uvicorn in this process.

    serve_with_replicas(config, ReplicaConfig(replicas=2), "127.0.0.1", 8000, cluster="local")
    serve_with_workers(config, 2, "127.0.0.1", 8000, sock=bind_socket("127.0.0.1", 8000))

Start-up in the order of the single server's (`server.runner.serve`): the port is bound first (by the caller),
then the replicas load (each its model, index and cache: `serve_replicas.deploy_replicas`), then the front opens
the index for retrieval and serves. SIGINT or SIGTERM stop uvicorn, then the replicas are deleted (each finishes
its in-flight requests within the shutdown grace) and a private Ray instance is shut down.
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from hypic_rag.distributed.cluster import ClusterConfig, connect, disconnect_if_local
from hypic_rag.distributed.front import Front, IndexRetriever, ReplicaStartError, create_front_app
from hypic_rag.distributed.serve_replicas import ReplicaConfig, deploy_replicas, remove_replicas
from hypic_rag.server import ServerConfig

logger = logging.getLogger(__name__)


def start_replicas(config: ServerConfig, options: ReplicaConfig, cluster: ClusterConfig) -> tuple[Any, Front, IndexRetriever]:
    """Connect, deploy the replicas, open the front's retriever; (ray, front, retriever)."""
    ray = connect(cluster)
    try:
        clients = deploy_replicas(ray, config, options)
    except Exception as error:  # noqa: BLE001 - Serve's deployment failures carry long multi-line messages
        remove_replicas(options.replicas)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ReplicaStartError(f"a replica could not start: {lines[-1] if lines else type(error).__name__}"[:600]) from None
    retriever = IndexRetriever(config)
    return ray, Front(config, clients, retriever.chunk_ids), retriever


def serve_with_replicas(
    config: ServerConfig, options: ReplicaConfig, host: str, port: int, *, cluster: ClusterConfig, sock: socket.socket,
    log_level: str = "info", on_ready: Callable[[], None] | None = None, max_in_flight: int | None = None,
) -> bool:
    """Serve the front on `sock` until SIGINT or SIGTERM; False if uvicorn failed to start."""
    ray, front, retriever = start_replicas(config, options, cluster)
    if max_in_flight is not None:
        front.router.max_in_flight = max_in_flight
    try:
        return run_front(front, host, port, sock=sock, log_level=log_level, on_ready=on_ready)
    finally:
        retriever.close()
        remove_replicas(options.replicas)
        disconnect_if_local(ray, cluster)


def serve_with_workers(
    config: ServerConfig, workers: int, host: str, port: int, *, sock: socket.socket, log_level: str = "info",
    on_ready: Callable[[], None] | None = None, max_in_flight: int | None = None, threads: int | None = None,
) -> bool:
    """`serve --workers N`: N local worker processes (`local_workers.LocalWorkers`, each loads the model, with
    `threads` intra-op threads: None shares the cores out), then the front on `sock`, routing by load (the document
    routes to the index's owner, over a writable index), until SIGINT or SIGTERM; the workers stop after the
    front. False if uvicorn failed to start; `ReplicaStartError` if a worker could not load."""
    from hypic_rag.distributed.local_workers import LocalWorkers

    pool = LocalWorkers(config, workers, threads=threads,
                        log_level="warning" if log_level == "info" else log_level).start()
    front = Front(config, pool.clients, retrieve=None, owner=pool.owner)
    if max_in_flight is not None:
        front.router.max_in_flight = max_in_flight
    try:
        with pool.watching(router=front.router):  # a dead worker leaves the rotation at once
            return run_front(front, host, port, sock=sock, log_level=log_level, on_ready=on_ready)
    finally:
        pool.stop()


def run_front(
    front: Front, host: str, port: int, *, sock: socket.socket, log_level: str = "info",
    on_ready: Callable[[], None] | None = None,
) -> bool:
    """Serve `front`'s application on `sock` until SIGINT or SIGTERM (the replicas are the caller's to stop);
    False if uvicorn failed to start."""
    server = uvicorn.Server(uvicorn.Config(
        create_front_app(front), host=host, port=port, log_level=log_level, lifespan="off",
        timeout_graceful_shutdown=max(1, int(front.config.shutdown_grace_s)), access_log=log_level == "debug",
    ))
    if on_ready is not None:
        on_ready()
    previous = signal.signal(signal.SIGTERM, _ignore_signal)
    try:
        server.run(sockets=[sock])
    except SystemExit:
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)
    return bool(server.started)


def _ignore_signal(signum: int, frame: object) -> None:
    logger.debug("signal %d after shutdown ignored", signum)
