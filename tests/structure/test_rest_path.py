"""The REST path's shape, read from the source with `ast` (nothing is imported): `hypic_rag.distributed` builds on
the server's public app factory and config only, and the streaming routes share one SSE relay (`server/sse.py`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hypic_rag"
SERVER_PUBLIC = {
    "hypic_rag.server": {"ServerConfig", "DEFAULT_SEPARATOR", "create_app", "limit_body_size", "check_api_keys",
                         "app_ready", "stop_app", "unreadable_body_response", "unavailable_response", "WRITE_PREFIXES"},
    "hypic_rag.server.config": {"ServerConfig", "DEFAULT_SEPARATOR"},
}
"""What other packages may import from the server: its package's public names and its config module."""


def server_imports(source: str) -> list[str]:
    """`module.name` (or `module` for a plain import) of every import from `hypic_rag.server` in `source` outside
    `SERVER_PUBLIC`, anywhere in the file (inside functions too)."""
    offenders = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            offenders += [alias.name for alias in node.names
                          if alias.name.startswith("hypic_rag.server") and alias.name not in SERVER_PUBLIC]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hypic_rag.server"):
            allowed = SERVER_PUBLIC.get(node.module or "", set())
            offenders += [f"{node.module}.{alias.name}" for alias in node.names if alias.name not in allowed]
    return offenders


def relays_of(source: str) -> list[str]:
    """Async generator functions of `source` (a relay of events of its own), and its uses of SSE framing."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AsyncFunctionDef) and any(
            isinstance(inner, (ast.Yield, ast.YieldFrom)) for inner in ast.walk(node)
        ):
            found.append(f"async generator {node.name}")
        if isinstance(node, ast.ImportFrom) and node.module == "hypic_rag.server.sse":
            found += [f"imports {alias.name}" for alias in node.names
                      if alias.name in ("sse_event", "sse_response", "DONE")]
    return found


def test_distributed_builds_on_the_servers_public_factory_and_config_only() -> None:
    sources = {path.name: path.read_text(encoding="utf-8") for path in (PACKAGE / "distributed").glob("*.py")}
    assert {"front.py", "serve_replicas.py"} <= set(sources)
    offenders = {name: found for name, source in sources.items() if (found := server_imports(source))}
    assert offenders == {}
    uses = [name for name, source in sources.items() if "hypic_rag.server" in source]
    assert "serve_replicas.py" in uses and "front.py" in uses  # the check reads the files that do import it


def test_the_streaming_routes_share_one_sse_relay() -> None:
    routes = {path.name: path.read_text(encoding="utf-8") for path in (PACKAGE / "server").glob("routes_*.py")}
    streaming = {name for name, source in routes.items() if "stream_response(" in source}
    assert streaming == {"routes_ask.py", "routes_chat.py", "routes_completions.py"}
    assert {name: found for name, source in routes.items() if (found := relays_of(source))} == {}
    sse = (PACKAGE / "server" / "sse.py").read_text(encoding="utf-8")
    assert relays_of(sse) == ["async generator relay"]


def test_the_checks_above_can_fail() -> None:
    assert server_imports("from hypic_rag.server.service import Service") == ["hypic_rag.server.service.Service"]
    assert server_imports("def f():\n    import hypic_rag.server.worker\n") == ["hypic_rag.server.worker"]
    assert server_imports("from hypic_rag.server import ServerConfig, create_app") == []
    assert server_imports("from hypic_rag.server import Service") == ["hypic_rag.server.Service"]
    own = "async def _relay(stream):\n    async for item in stream:\n        yield item\n"
    assert relays_of(own) == ["async generator _relay"]
    assert relays_of("from hypic_rag.server.sse import DONE, stream_response") == ["imports DONE"]
