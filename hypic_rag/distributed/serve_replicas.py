"""The replicas of `hypic-rag serve --replicas N`: Ray Serve deployments, one per replica id, behind `front.py`.

Each replica is a Ray Serve deployment of one `ReplicaServer` (named `hypic-replica-<i>`, its own application
without an HTTP route): the single-process service (`server.Service` over `ServiceBackend`: model, engine,
segment cache, index read-only) and its FastAPI application, which requests reach through
`asgi_bridge.stream_asgi` as a streaming deployment call. Serve places the replicas (one GPU each on a GPU
cluster, else `replica_cpus` CPU slots), health-checks them (`check_health`: the model worker is ready) and
restarts one that dies.

One deployment per replica, and not one deployment of N replicas, because the front chooses the replica: a request
must reach the replica that holds its chunks hot (rendezvous hashing over the chunk ids it retrieves), which a
deployment's own router (power of two choices on queue length) does not know; a custom Serve request router would
have to retrieve inside Serve's routing loop. Serve's HTTP proxy is not used (it could carry the streams: Serve
streams `StreamingResponse`s), because the front must retrieve before it routes and binds its port before any
model loads, as the single server does.

The replicas on one host share its LMDB segment cache (one writer at a time, many readers), unless `cache_dir`
names a directory per replica (``{replica}``); all of them share the remote tier below it (`remote_cache`): the
whole `ServerConfig` is handed to every replica, so an entry one replica encodes is a remote hit on every other
replica that lacks it locally. Each replica builds its own S3 client, with the credentials of its node's
environment (the standard AWS chain of the Ray worker: variables set where the node was started, a profile,
an instance role), never the front's: credentials are not shipped through the cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart, stream_asgi
from hypic_rag.server import ServerConfig

logger = logging.getLogger(__name__)

APP_PREFIX = "hypic-replica-"


class ReplicaServer:
    """One replica: the service over the index, read-only, and its application (runs inside a Serve replica)."""

    def __init__(self, config: ServerConfig, replica: str) -> None:
        from hypic_rag.server import create_app

        began = time.perf_counter()
        self.replica = replica
        config = config.for_replica(replica)  # read-only; its own cache directory when `{replica}` names one
        self.app = create_app(config, start=True)
        logger.info("replica %s ready in %.1f s", replica, time.perf_counter() - began)

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The response to `request`, streamed: a `ResponseStart`, then body parts."""
        async for part in stream_asgi(self.app, request):
            yield part

    def check_health(self) -> None:
        """Serve's health check: fails while the model worker is not ready (or has stopped)."""
        from hypic_rag.server import app_ready

        if not app_ready(self.app):
            raise RuntimeError(f"replica {self.replica}: the model worker is not ready")

    def __del__(self) -> None:
        app = getattr(self, "app", None)
        if app is not None:
            from hypic_rag.server import stop_app

            stop_app(app)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """How many replicas, and what each holds: `replica_cpus` CPU slots, one GPU when `gpu`. Serve lets up to
    `queue_size + 16` requests reach one replica at once; its own queue answers 429 beyond `queue_size`."""

    replicas: int
    replica_cpus: float = 1.0
    gpu: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be >= 0, got {self.replica_cpus}")


class ServeReplicaClient:
    """A `front.ReplicaClient` over one replica's Serve deployment handle."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True)

    async def stream(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        responses = self.handle.handle.remote(request)
        finished = False
        try:
            async for part in responses:
                yield part
            finished = True
        finally:
            if not finished:
                responses.cancel()  # the client went away: the replica's request is stopped


def replica_names(count: int) -> list[str]:
    return [f"{APP_PREFIX}{number}" for number in range(count)]


def deploy_replicas(ray: Any, config: ServerConfig, options: ReplicaConfig) -> dict[str, ServeReplicaClient]:
    """Start Serve (no HTTP proxy) on the connected cluster and `options.replicas` replica applications, and wait
    until every one has loaded its model; replica id -> client. The replicas open the index read-only
    (`ServerConfig.for_replica`)."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    actor_options: dict[str, Any] = {"num_cpus": options.replica_cpus}
    if options.gpu:
        actor_options["num_gpus"] = 1
    deployment = serve.deployment(
        ReplicaServer, num_replicas=1, max_ongoing_requests=config.queue_size + 16,
        ray_actor_options=actor_options, health_check_period_s=10.0,
        graceful_shutdown_timeout_s=max(1.0, config.shutdown_grace_s),
    )
    names = replica_names(options.replicas)
    targets = [serve.RunTarget(deployment.options(name=name).bind(config, name), name=name, route_prefix=None)
               for name in names]
    handles = serve.run_many(targets)
    return {name: ServeReplicaClient(handle) for name, handle in zip(names, handles)}


def remove_replicas(count: int) -> None:
    """Delete the replica applications (each replica's service stops: in-flight requests get the shutdown grace)."""
    from ray import serve

    for name in replica_names(count):
        try:
            serve.delete(name)
        except Exception as error:  # noqa: BLE001 - shutting down: a replica already gone is fine
            logger.debug("replica %s: %s", name, error)
