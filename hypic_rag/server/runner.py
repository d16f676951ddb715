"""Running the service with uvicorn: in the foreground (`serve`, for the CLI) or in a thread (`ServerThread`,
for tests, examples and notebooks).

    with ServerThread(ServerConfig(index_dir="index/")) as server:
        httpx.post(f"{server.url}/v1/ask", json={"question": "..."})

Both bind 127.0.0.1 unless told otherwise; port 0 picks a free port (read it from `ServerThread.port`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import TracebackType

import uvicorn

from hypic_rag.server.app import create_app
from hypic_rag.server.config import ServerConfig

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def uvicorn_config(config: ServerConfig, host: str, port: int, *, log_level: str = "info") -> uvicorn.Config:
    """One process, one event loop, the app's lifespan on; open connections get the shutdown grace period."""
    return uvicorn.Config(
        create_app(config),
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)),
        access_log=log_level == "debug",
    )


def serve(config: ServerConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, log_level: str = "info") -> bool:
    """Serve until SIGINT or SIGTERM, then shut down gracefully; False if the server failed to start.

    uvicorn re-raises the signal it caught once it has shut down; SIGTERM then meets a handler that ignores it,
    so a terminated server exits normally (SIGINT still ends as KeyboardInterrupt).
    """
    server = uvicorn.Server(uvicorn_config(config, host, port, log_level=log_level))
    previous = signal.signal(signal.SIGTERM, _ignore_signal)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return bool(server.started)


def _ignore_signal(signum: int, frame: object) -> None:
    logger.debug("signal %d after shutdown ignored", signum)


class ServerThread:
    """A real uvicorn server in a background thread; `start()` returns once it accepts connections."""

    def __init__(
        self, config: ServerConfig, host: str = DEFAULT_HOST, port: int = 0, *, log_level: str = "warning"
    ) -> None:
        self.server = uvicorn.Server(uvicorn_config(config, host, port, log_level=log_level))
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="hypic-uvicorn", daemon=True)

    @property
    def app(self):  # noqa: ANN201 - the FastAPI app
        return self.server.config.app

    @property
    def port(self) -> int:
        sockets = [sock for server in getattr(self.server, "servers", []) for sock in server.sockets]
        if not sockets:
            raise RuntimeError("the server is not listening")
        return int(sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server failed to start (see the log for the reason)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout_s:g} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Graceful shutdown, as on SIGTERM: in-flight requests finish, then the worker closes the cache."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("the server thread did not stop within %.0f s", timeout_s)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
