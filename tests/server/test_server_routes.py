"""Every route of the service takes its `Service` through one FastAPI dependency (`ServiceDep`), run on the event
loop; no route module reaches into `app.state` itself. (The routes' behaviour is tested against a real uvicorn
server in test_server_api.py and test_server_robustness.py.)"""

from __future__ import annotations

import inspect
from pathlib import Path

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from hypic_rag.server import routes_admin, routes_ask, routes_completions, routes_documents
from hypic_rag.server.service import current_service

SERVER = Path(__file__).resolve().parents[2] / "hypic_rag" / "server"


def dependency_calls(dependant: Dependant) -> set[object]:
    calls: set[object] = set()
    for child in dependant.dependencies:
        calls.add(child.call)
        calls |= dependency_calls(child)
    return calls


def test_every_route_gets_the_service_through_the_one_dependency() -> None:
    routers = (routes_ask.router, routes_completions.router, routes_documents.router, routes_admin.router)
    routes = [route for router in routers for route in router.routes if isinstance(route, APIRoute)]
    assert {route.path for route in routes} >= {"/v1/ask", "/v1/completions", "/v1/models", "/v1/documents",
                                                "/v1/jobs/{job_id}", "/healthz", "/metrics", "/v1/cache/stats"}
    missing = [route.path for route in routes if current_service not in dependency_calls(route.dependant)]
    assert missing == []
    assert inspect.iscoroutinefunction(current_service)  # never queued behind FastAPI's thread pool
    readers = sorted(path.name for path in SERVER.glob("*.py") if "app.state.service" in path.read_text()
                     and path.name not in ("app.py", "service.py"))  # app.py sets it, service.py reads it once
    assert readers == []
