"""Running the service with uvicorn: in the foreground (`serve`, for the CLI) or in a thread (`ServerThread`,
for tests, examples and notebooks).

    with ServerThread(ServerConfig(index_dir="index/")) as server:
        httpx.post(f"{server.url}/v1/ask", json={"question": "..."})

Both bind 127.0.0.1 unless told otherwise; port 0 picks a free port (read it from `ServerThread.port`).

`serve` starts in the order that makes start-up failures cheap and plain: bind the port first (`bind_socket`:
a port in use is `AddressInUseError` before any model is loaded), then open the backend in the model worker (its
errors, such as an index built for another model or a writer lock held elsewhere, are raised as they are), and
only then hand the bound socket to uvicorn.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

import uvicorn

from hypic_rag.errors import HypicError
from hypic_rag.server.config import ServerConfig

if TYPE_CHECKING:
    from hypic_rag.server.service import Service

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


class AddressInUseError(HypicError, OSError):
    """The address to serve on cannot be bound (another server holds the port, or the host is not local); still an
    OSError, raised as `AddressInUseError(errno, message)`. Exit code 1 (`serve` adds what to do about it)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; `AddressInUseError` when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT leftovers do not block
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        reason = "address already in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error))
        raise AddressInUseError(error.errno, f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    config: ServerConfig, host: str, port: int, *, log_level: str = "info", service: Service | None = None
) -> uvicorn.Config:
    """One process, one event loop, the app's lifespan on; open connections get the shutdown grace period."""
    from hypic_rag.server.app import create_app  # torch and the model code: not needed to bind a port
    from hypic_rag.server.request_log import install_protocol_error_filter

    install_protocol_error_filter()
    return uvicorn.Config(
        create_app(config, service=service),
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(config.shutdown_grace_s)),
        access_log=log_level == "debug",
    )


def serve(
    config: ServerConfig, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *, log_level: str = "info",
    sock: socket.socket | None = None, on_ready: Callable[[], None] | None = None,
) -> bool:
    """Serve until SIGINT or SIGTERM, then shut down gracefully; False if uvicorn failed to start.

    Binds (host, port) first unless given a bound `sock` (`AddressInUseError` before anything loads), then opens
    the backend (model, index, cache; its error is raised here, with no server started), calls `on_ready`, then
    serves.
    uvicorn re-raises the signal it caught once it has shut down; SIGTERM then meets a handler that ignores it,
    so a terminated server exits normally (SIGINT still ends as KeyboardInterrupt).
    """
    own_socket = sock is None
    if sock is None:
        sock = bind_socket(host, port)
    try:
        from hypic_rag.server.backend import ServiceBackend
        from hypic_rag.server.service import Service

        service = Service(config, lambda: ServiceBackend.open(config))
        service.start()
        if on_ready is not None:
            on_ready()
        try:
            server = uvicorn.Server(uvicorn_config(config, host, port, log_level=log_level, service=service))
            previous = signal.signal(signal.SIGTERM, _ignore_signal)
            try:
                server.run(sockets=[sock])
            except SystemExit:  # uvicorn's own start-up failure (reason logged)
                return False
            finally:
                signal.signal(signal.SIGTERM, previous)
        finally:
            service.stop()  # a no-op after the app's shutdown already stopped it
        return bool(server.started)
    finally:
        if own_socket:
            sock.close()


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
