"""HTTP/1.1 to one local server over its Unix socket: how the front of `serve --workers N` reaches each worker
(`local_workers.WorkerClient`).

A client for one peer that is known to speak HTTP/1.1 (the worker's uvicorn), on asyncio's own streams: a request
goes out as one write (request line, headers, body); the response's status line and headers are parsed, then its
body is relayed as it arrives (a Content-Length body, a chunked one: the worker's streams, or one that ends when
the connection does). Connections are kept alive in a small pool and reused, newest first, only after a response
was read to its end; a response left early (the front's client went away) closes its connection, so the worker
sees its client go.

    pool = UnixHttpPool("/tmp/worker-0.sock")
    async for part in pool.stream(ForwardedRequest("GET", "/healthz")):
        ...  # a ResponseStart, then the body's parts (bytes)

`ReplicaUnreachable` is raised before the `ResponseStart` when the socket refuses the connection or the worker closes
it (or answers what is not HTTP/1.1) before its response starts: the request was not answered, and the front may
send it to another worker. A connection the worker closed while it sat idle in the pool (its keep-alive timeout)
is not an unreachable worker: the request is sent once more on a new connection. After the start, a connection
lost mid-body ends the parts with `ReplicaUnreachable` (the response is cut short; the front cuts its own).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from urllib.parse import quote

from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart
from hypic_rag.distributed.front import ReplicaUnreachable

logger = logging.getLogger(__name__)

HEAD_LIMIT_BYTES = 1 << 20
"""The most bytes of a response's status line and headers (and of a chunk-size line) read before it is refused."""
READ_BYTES = 1 << 16
"""The most body bytes relayed as one part."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds a connection may take to open (a worker's backlog full for that long: unreachable)."""
NO_BODY_STATUSES = frozenset({204, 304})
PATH_SAFE = "/:@!$&'()*+,;=-._~"
"""Characters a path keeps unquoted when it is written into the request line (RFC 3986 `pchar` and `/`)."""


class _Connection:
    """One keep-alive connection: its stream pair and whether it served a request before (`reused`)."""

    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def idle_closed(self) -> bool:
        """Whether the peer closed it (or it broke) while it sat idle: end of stream, or its transport closing."""
        return self.reader.at_eof() or self.writer.transport.is_closing() or self.reader.exception() is not None

    def close(self) -> None:
        self.writer.transport.abort()  # nothing of ours is pending: the request went out whole


def request_head(request: ForwardedRequest, host: bytes) -> bytes:
    """The request line and headers of `request`, as written on the connection (`host` is its Host header; a body
    without a Content-Length header gets one)."""
    target = request.raw_path if request.raw_path else quote(request.path, safe=PATH_SAFE).encode("ascii")
    if request.query_string:
        target += b"?" + request.query_string
    lines = [request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    has_length = False
    for name, value in request.headers:
        has_length = has_length or name.lower() == b"content-length"
        lines += [name, b": ", value, b"\r\n"]
    if not has_length and (request.body or request.method.upper() in ("POST", "PUT", "PATCH")):
        lines += [b"content-length: ", str(len(request.body)).encode("ascii"), b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)


def parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
    """A response's status line and header lines (up to and with the blank line) -> (status, [(name, value)]);
    names lower-cased, values stripped. ValueError if it is not an HTTP/1.x response head."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise ValueError(f"malformed header line: {line[:80]!r}")
        headers.append((name.lower(), value.strip()))
    return int(code), headers


def _body_framing(method: str, status: int, headers: list[tuple[bytes, bytes]]) -> tuple[bool, int | None]:
    """(chunked, length) of a response's body: length 0 for none, None for one that lasts until the connection
    closes (RFC 9112 6.3)."""
    if method.upper() == "HEAD" or status in NO_BODY_STATUSES or 100 <= status < 200:
        return False, 0
    encodings = [value.lower() for name, value in headers if name == b"transfer-encoding"]
    if encodings:
        if encodings[-1].rsplit(b",", 1)[-1].strip() != b"chunked":
            return False, None
        return True, None
    lengths = {value for name, value in headers if name == b"content-length"}
    if lengths:
        if len(lengths) != 1 or not next(iter(lengths)).isdigit():
            raise ValueError(f"bad content-length: {sorted(lengths)}")
        return False, int(next(iter(lengths)))
    return False, None


async def _sized_parts(reader: asyncio.StreamReader, size: int) -> AsyncIterator[bytes]:
    """The next `size` bytes of `reader` as they arrive, in parts of at most `READ_BYTES`; `IncompleteReadError` if
    the stream ends first."""
    while size:
        part = await reader.read(min(size, READ_BYTES))
        if not part:
            raise asyncio.IncompleteReadError(b"", size)
        size -= len(part)
        yield part


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"


def _keeps_alive(headers: list[tuple[bytes, bytes]]) -> bool:
    return not any(name == b"connection" and b"close" in [token.strip() for token in value.lower().split(b",")]
                   for name, value in headers)


class UnixHttpPool:
    """HTTP/1.1 requests to the server listening on `socket_path`, over a pool of at most `max_idle` idle
    keep-alive connections (as many are opened as requests run at once)."""

    def __init__(self, socket_path: str, *, name: str = "", max_idle: int = 256, host: str = "worker") -> None:
        self.socket_path = socket_path
        self.name = name or socket_path
        self.max_idle = max_idle
        self.host = host.encode("ascii")
        self._idle: list[_Connection] = []
        self.opened = 0
        """Connections opened so far (the tests read it to see reuse)."""

    async def _open(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=HEAD_LIMIT_BYTES), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as error:
            raise ReplicaUnreachable(f"{self.name}: cannot connect ({_one_line(error)})") from None
        self.opened += 1
        return _Connection(reader, writer)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.idle_closed():
                connection.reused = True
                return connection
            connection.close()
        return None

    def _give_back(self, connection: _Connection) -> None:
        if len(self._idle) < self.max_idle and not connection.idle_closed():
            self._idle.append(connection)
        else:
            connection.close()

    async def _send_and_read_head(self, connection: _Connection, head: bytes,
                                  body: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """Write the request; read the response's head, past any 1xx interim response. `ReplicaUnreachable` if
        the connection ends or breaks before a response starts; ValueError for a head that is not HTTP/1.x."""
        reader = connection.reader
        try:
            connection.writer.write(head + body if len(body) < READ_BYTES else head)
            if len(body) >= READ_BYTES:
                connection.writer.write(body)
            while True:
                status, headers = parse_head(await reader.readuntil(b"\r\n\r\n"))
                if not 100 <= status < 200 or status == 101:
                    return status, headers
        except asyncio.IncompleteReadError as error:
            where = "in the middle of the response's headers" if error.partial else "before a response"
            raise ReplicaUnreachable(f"{self.name}: the connection closed {where}") from None
        except asyncio.LimitOverrunError:
            raise ValueError(f"response headers over {HEAD_LIMIT_BYTES} bytes") from None
        except OSError as error:
            raise ReplicaUnreachable(f"{self.name}: {_one_line(error)}") from None

    async def stream(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The server's response to `request`: a `ResponseStart`, then the body's non-empty parts as they arrive
        (see the module docstring for `ReplicaUnreachable`). Closing the iteration before its end closes the
        connection."""
        head = request_head(request, self.host)
        connection = self._take_idle() or await self._open()
        try:
            try:
                status, headers = await self._send_and_read_head(connection, head, request.body)
            except ReplicaUnreachable:
                if not connection.reused:
                    raise
                connection.close()
                connection = await self._open()  # it was closed while idle: the request never reached the server
                status, headers = await self._send_and_read_head(connection, head, request.body)
            chunked, length = _body_framing(request.method, status, headers)
        except ValueError as error:
            connection.close()
            raise ReplicaUnreachable(f"{self.name}: not an HTTP/1.1 response ({error})") from None
        except BaseException:
            connection.close()  # cancelled while waiting for the head: the server sees the client go
            raise
        finished = False
        try:
            yield ResponseStart(status, headers)
            reader = connection.reader
            if chunked:
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailer fields: not relayed (the front's response is chunked anew)
                        break
                    async for part in _sized_parts(reader, size):
                        yield part
                    if await reader.readexactly(2) != b"\r\n":
                        raise ValueError("a chunk does not end with CRLF")
            elif length is None:
                while part := await reader.read(READ_BYTES):
                    yield part
                return  # a body to the end of the connection: never reused
            else:
                async for part in _sized_parts(reader, length):
                    yield part
            finished = _keeps_alive(headers)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError) as error:
            raise ReplicaUnreachable(f"{self.name}: the response was cut short ({_one_line(error)})") from None
        finally:
            if finished:
                self._give_back(connection)
            else:
                connection.close()  # left early, cut short or not reusable: the server sees the client go

    def close(self) -> None:
        """Close every idle connection."""
        while self._idle:
            self._idle.pop().close()
