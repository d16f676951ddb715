"""Operations: `GET /healthz`, `GET /metrics` (Prometheus text) and `GET /v1/cache/stats`."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from hypic_rag.server.metrics import CONTENT_TYPE
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.schemas import AnsweringOut, CacheStatsOut, HealthOut
from hypic_rag.server.service import ServiceDep
from hypic_rag.server.task_context import TaskContext

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=HealthOut, responses={503: {"description": "Starting or shutting down."}},
            summary="Liveness and readiness")
async def healthz(service: ServiceDep) -> JSONResponse:
    """200 when the model worker is ready; 503 while it starts or shuts down. Never waits on the worker."""
    worker = service.worker
    backend = worker.backend
    status = "ok" if worker.ready else ("shutting_down" if worker.stopping else "starting")
    counts = backend.counts if backend is not None else None
    health = HealthOut(
        status=status,
        model=backend.model_name if backend is not None else "",
        index=str(service.config.index_dir),
        read_only=service.config.read_only,
        documents=counts.documents if counts else 0,
        chunks=counts.chunks if counts else 0,
        queue_depth=service.queue_depth,
        queue_capacity=worker.queue_size,
        pending_jobs=worker.pending_jobs,
        uptime_s=round(time.time() - service.started_at, 3),
    )
    return JSONResponse(health.model_dump(), status_code=200 if status == "ok" else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus text exposition format."}})
async def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/cache/stats", response_model=CacheStatsOut, summary="Segment cache and index statistics")
async def cache_stats(service: ServiceDep) -> CacheStatsOut:
    """Fresh counters of the persistent segment cache (read by the model worker), the index's size, and this
    server's segment lookups and token accounting."""

    def run(backend: Any, context: TaskContext) -> tuple[dict[str, Any], Any, AnsweringOut]:
        backend.follow_index_writer()  # a reader's counts include what the index's owner committed
        return backend.refresh_cache_snapshot(), backend.counts, answering(backend, service.config)

    snapshot, counts, how = await service.control(run)
    return CacheStatsOut(
        cache=snapshot,
        index={"documents": counts.documents, "chunks": counts.chunks, "tokens": counts.tokens},
        server=service.metrics.server_summary(),
        answering=how,
    )


def answering(backend: Any, config: ServerConfig) -> AnsweringOut:
    """The served model and the recompute policy a `hypic` answer uses unless the request names one, with where
    that policy comes from (`ModelSession.for_index`: the server's option, else the index's calibrated policy)."""
    session = backend.pipeline.session
    if config.recompute_policy is not None:
        origin = "serve"
    elif backend.pipeline.index.manifest.recompute_policy_spec is not None:
        origin = "calibration"
    else:
        origin = "default"
    return AnsweringOut(model=backend.model_name, recompute_policy=session.recompute_policy.resolved(session.seam_tokens).spec,
                        policy_from=origin, seam_tokens=session.seam_tokens)
