"""The front's HTTP/1.1 client for local workers (`unix_http.UnixHttpPool`) against a real asyncio server on a Unix
socket in this test, each scripted to answer as the case needs: a Content-Length body and the request as written,
a chunked body relayed part by part as it arrives, keep-alive reuse, a server that closes before answering
(`ReplicaUnreachable`, so the front may retry elsewhere), a connection closed while idle or by the keep-alive race
(sent again on a new one), a response cut short mid-body, an interim 100 response, HEAD, and an iteration closed
early (the server sees its client go, and that connection is not reused). Then the front itself on a real uvicorn
over such workers: a stream relayed, a client that leaves mid-stream closing the worker's connection, a body cut
short, the keys, 503 for an unreachable owner, its own routes and 405 kept. Last, a relay cancelled as the worker's
next bytes arrive leaves no loop error on uvloop (httpx's UDS client logged 40 `InvalidStateError`s in this scenario,
two per request)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart
from hypic_rag.distributed.front import Front, ReplicaUnreachable, create_front_app
from hypic_rag.distributed.local_workers import WorkerClient
from hypic_rag.distributed.unix_http import UnixHttpPool, parse_head, request_head
from hypic_rag.server import ServerConfig
from hypic_rag.testing import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""(reader, writer, request number on the server) -> whether to keep the connection open for another request."""


class ScriptedServer:
    """A real asyncio Unix-socket server: reads each request (head and Content-Length body) and lets `handler`
    answer it; records every request's bytes and counts the connections accepted."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = str(path)
        self.handler = handler
        self.requests: list[bytes] = []
        self.connections = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        for writer in self._writers:  # connections still open in a pool: closed here, so the server can end
            writer.close()
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                if not await self.handler(reader, writer, len(self.requests)):
                    return
        finally:
            writer.close()


async def collect(pool: UnixHttpPool, request: ForwardedRequest) -> tuple[ResponseStart, list[bytes]]:
    parts = [part async for part in pool.stream(request)]
    assert isinstance(parts[0], ResponseStart) and all(isinstance(part, bytes) and part for part in parts[1:])
    return parts[0], parts[1:]  # type: ignore[return-value]


def answer(status_line: bytes, headers: list[bytes], body: bytes = b"") -> bytes:
    return status_line + b"\r\n" + b"".join(header + b"\r\n" for header in headers) + b"\r\n" + body


def socket_path(tmp_path: Path) -> Path:
    return tmp_path / "w.sock"


def test_a_content_length_body_and_the_request_as_written(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 201 Created", [b"Content-Type: application/json", b"content-length: 11",
                                                        b"set-cookie: a=1", b"Set-Cookie: b=2"], b'{"ok": true}'[:11]))
        return True

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path, name="worker-0")
            request = ForwardedRequest("POST", "/v1/a b", b"x=1&y=%20", ((b"content-type", b"application/json"),
                                                                            (b"content-length", b"9")), b'{"q": 12}')
            start, body = await collect(pool, request)
            assert start.status == 201
            assert start.headers == [(b"content-type", b"application/json"), (b"content-length", b"11"),
                                     (b"set-cookie", b"a=1"), (b"set-cookie", b"b=2")]  # repeated names kept
            assert b"".join(body) == b'{"ok": true'
            assert server.requests == [b"POST /v1/a%20b?x=1&y=%20 HTTP/1.1\r\nhost: worker\r\n"
                                       b"content-type: application/json\r\ncontent-length: 9\r\n\r\n" b'{"q": 12}']
            raw = ForwardedRequest("GET", "/v1/documents/a/b", raw_path=b"/v1/documents/a%2Fb")
            await collect(pool, raw)
            assert server.requests[1].startswith(b"GET /v1/documents/a%2Fb HTTP/1.1\r\n")  # the client's own path
            assert server.connections == 1 and pool.opened == 1  # read to its end: the connection was reused

    asyncio.run(run())


def test_a_chunked_body_is_relayed_part_by_part_as_it_arrives(tmp_path: Path) -> None:
    first_part_seen = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"content-type: text/event-stream",
                                                 b"Transfer-Encoding: chunked"]) + b"7\r\ndata: 1\r\n")
        await first_part_seen.wait()  # the rest only once the client has relayed the first part
        writer.write(b"B;name=value\r\ndata: 2\n\n\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"3\r\nend\r\n0\r\ntrailer: x\r\n\r\n")
        return True

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path)
            parts = []
            async for part in pool.stream(ForwardedRequest("GET", "/stream")):
                parts.append(part)
                if part == b"data: 1":
                    first_part_seen.set()
            assert isinstance(parts[0], ResponseStart) and parts[0].status == 200
            assert b"".join(parts[1:]) == b"data: 1data: 2\n\n\r\nend"  # chunk boundaries and extensions gone
            assert parts[1] == b"data: 1"
            start, body = await collect(pool, ForwardedRequest("GET", "/again"))  # trailer read: reusable
            assert b"".join(body) == b"data: 1data: 2\n\n\r\nend" and server.connections == pool.opened == 1

    asyncio.run(run())


def test_a_server_that_closes_before_answering_is_unreachable(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        return False  # reads the request, closes without a response (a worker that died)

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path, name="worker-1")
            with pytest.raises(ReplicaUnreachable, match="worker-1: the connection closed before a response"):
                await anext(pool.stream(ForwardedRequest("POST", "/v1/ask", body=b"{}")))
            assert len(server.requests) == 1  # sent once: a fresh connection is never retried
        with pytest.raises(ReplicaUnreachable, match="cannot connect"):
            await anext(UnixHttpPool(str(tmp_path / "none.sock")).stream(ForwardedRequest("GET", "/")))

    asyncio.run(run())


def test_a_connection_closed_while_idle_or_by_the_keep_alive_race_is_sent_again_on_a_new_one(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        if number == 3:
            return False  # the keep-alive race: the server closes as the reused connection's request arrives
        writer.write(answer(b"HTTP/1.1 200 OK", [b"content-length: 2"], b"ok"))
        return number != 1  # the first connection is closed after its response (a keep-alive timeout)

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path)
            for _ in range(3):
                start, body = await collect(pool, ForwardedRequest("GET", "/healthz"))
                assert start.status == 200 and body == [b"ok"]
                await asyncio.sleep(0.01)  # the close reaches the pool
            assert len(server.requests) == 4 and pool.opened == server.connections == 3

    asyncio.run(run())


def test_a_body_cut_short_ends_with_unreachable_after_the_start(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"content-length: 10"], b"12345"))
        await writer.drain()
        return False

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            parts = UnixHttpPool(server.path).stream(ForwardedRequest("GET", "/"))
            assert isinstance(await anext(parts), ResponseStart)
            assert await anext(parts) == b"12345"
            with pytest.raises(ReplicaUnreachable, match="cut short"):
                await anext(parts)

    asyncio.run(run())


def test_interim_responses_are_skipped_and_head_has_no_body(tmp_path: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        if number == 2:
            writer.write(answer(b"HTTP/1.1 200 OK", [b"content-length: 1000"]))  # HEAD: the length, no body
        else:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b"HTTP/1.1 200 OK", [b"content-length: 3"], b"abc"))
        return True

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path)
            start, body = await collect(pool, ForwardedRequest("POST", "/x", body=b"1"))
            assert start.status == 200 and body == [b"abc"]
            start, body = await collect(pool, ForwardedRequest("HEAD", "/x"))
            assert start.status == 200 and body == [] and (b"content-length", b"1000") in start.headers
            await collect(pool, ForwardedRequest("GET", "/x"))
            assert pool.opened == 1
            assert server.requests[0].endswith(b"content-length: 1\r\n\r\n1")  # a body gets its length

    asyncio.run(run())


def test_closing_the_iteration_early_closes_the_connection(tmp_path: Path) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"transfer-encoding: chunked"]) + b"3\r\none\r\n")
        await writer.drain()
        if number == 1:
            assert await reader.read() == b""  # the client's end: the rest is never sent
            gone.set()
            return False
        writer.write(b"0\r\n\r\n")
        return True

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path)
            parts = pool.stream(ForwardedRequest("GET", "/stream"))
            assert isinstance(await anext(parts), ResponseStart) and await anext(parts) == b"one"
            await parts.aclose()
            await asyncio.wait_for(gone.wait(), 10)  # the server saw its client go
            start, body = await collect(pool, ForwardedRequest("GET", "/stream"))
            assert body == [b"one"] and pool.opened == server.connections == 2  # the left one was not reused

    asyncio.run(run())


def test_heads_are_parsed_or_refused() -> None:
    assert parse_head(b"HTTP/1.1 404 Not Found\r\nX-A:  1 \r\nx-b:\r\n\r\n") == (404, [(b"x-a", b"1"), (b"x-b", b"")])
    for bad in (b"SSH-2.0-x\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n"):
        with pytest.raises(ValueError):
            parse_head(bad)
    assert request_head(ForwardedRequest("GET", "/h"), b"worker") == b"GET /h HTTP/1.1\r\nhost: worker\r\n\r\n"


@asynccontextmanager
async def front_on_uvicorn(front: Front) -> AsyncIterator[str]:
    """`front`'s application on a real uvicorn on 127.0.0.1, in this event loop: yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_front_app(front), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "the front did not start"
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


def test_the_front_relays_a_stream_and_a_client_that_goes_away_closes_the_workers_connection(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The front (`create_front_app` on a real uvicorn on 127.0.0.1) over a `WorkerClient` to a scripted worker:
    a streamed response comes through part by part with `X-Hypic-Replica`; a client that leaves mid-stream makes the
    worker's connection close (the worker sees its client go) and frees the router's slot, with nothing logged at
    ERROR; a worker that drops its connection mid-body cuts the client's response short (one warning)."""
    worker_saw_close = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"content-type: text/event-stream", b"transfer-encoding: chunked"])
                     + b"8\r\ndata: 1\n\r\n")
        await writer.drain()
        if number == 1:
            assert await reader.read() == b""  # nothing more is sent until the front's client goes
            worker_saw_close.set()
        return False  # the second: dropped in the middle of its body

    async def run() -> None:
        async with ScriptedServer(socket_path(tmp_path), handler) as worker:
            front = Front(ServerConfig(index_dir=tmp_path / "index"),
                          {"worker-0": WorkerClient("worker-0", worker.path)}, retrieve=None)
            async with front_on_uvicorn(front) as url:
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    async with client.stream("POST", "/v1/ask", json={"question": "q", "stream": True}) as response:
                        assert response.status_code == 200 and response.headers["x-hypic-replica"] == "worker-0"
                        assert await anext(response.aiter_raw()) == b"data: 1\n"
                    await asyncio.wait_for(worker_saw_close.wait(), 10)  # the client left: so did the front
                    with pytest.raises(httpx.RemoteProtocolError):  # cut short: the client sees it cut short
                        await client.post("/v1/ask", json={"question": "q"})
                assert front.router.snapshot()["in_flight"] == {"worker-0": 0}
                assert worker.requests[0].startswith(b"POST /v1/ask HTTP/1.1\r\nhost: worker\r\n")

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR
            and "without completing response" not in record.getMessage()] == []
    assert any("cut short" in record.getMessage() for record in caplog.records)


def test_the_front_answers_503_for_an_unreachable_owner_and_405_for_other_methods(tmp_path: Path) -> None:
    """The same front with worker-0 (the owner) not listening: a document route is 503 `unavailable` with
    `Retry-After` (sent to the owner alone), a question goes to worker-1, the API key is checked first, `GET
    /healthz` stays the front's own (degraded), and a method the front does not forward is 405."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"content-type: application/json", b"content-length: 2"], b"{}"))
        return True

    key = "sk-front-test-3f9a1c"

    async def run() -> None:
        async with ScriptedServer(tmp_path / "w1.sock", handler) as worker:
            clients = {"worker-0": WorkerClient("worker-0", str(tmp_path / "w0.sock")),
                       "worker-1": WorkerClient("worker-1", worker.path)}
            front = Front(ServerConfig(index_dir=tmp_path / "index", api_key=key), clients, retrieve=None,
                          owner="worker-0")
            async with front_on_uvicorn(front) as url:
                async with httpx.AsyncClient(base_url=url, timeout=30,
                                             headers={"Authorization": f"Bearer {key}"}) as client:
                    unkeyed = await client.post("/v1/ask", json={}, headers={"Authorization": ""})
                    assert unkeyed.status_code == 401 and worker.requests == []
                    document = await client.get("/v1/documents")
                    assert document.status_code == 503 and document.headers["retry-after"] == "1", document.text
                    assert document.json()["error"]["code"] == "unavailable" and "worker-0" in document.text
                    asked = await client.post("/v1/ask?x=1", json={"question": "q"})
                    assert asked.status_code == 200 and asked.headers["x-hypic-replica"] == "worker-1"
                    assert asked.json() == {} and worker.requests[-1].startswith(b"POST /v1/ask?x=1 HTTP/1.1\r\n")
                    health = await client.get("/healthz")
                    assert health.status_code == 503 and health.json()["status"] == "degraded"
                    assert (await client.request("TRACE", "/v1/ask")).status_code == 405

    asyncio.run(run())


def test_a_read_cancelled_as_the_worker_answers_leaves_no_loop_error_on_uvloop(tmp_path: Path) -> None:
    """The front's client went away (its relay task cancelled) in the same loop iteration as the worker's next bytes
    arrived: on uvloop, whose reader callbacks run in its poll phase, a wait that registered `future.set_result` as
    the reader logged `InvalidStateError` (httpcore's UDS transport through anyio did); this client logs nothing."""
    uvloop = pytest.importorskip("uvloop")
    writers: list[asyncio.StreamWriter] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int) -> bool:
        writer.write(answer(b"HTTP/1.1 200 OK", [b"transfer-encoding: chunked"]) + b"1\r\na\r\n")
        writers.append(writer)
        await reader.read()  # until the client goes
        return False

    async def run() -> list[str]:
        errors: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context["message"]))
        async with ScriptedServer(socket_path(tmp_path), handler) as server:
            pool = UnixHttpPool(server.path)
            for number in range(20):
                parts = pool.stream(ForwardedRequest("GET", "/stream"))
                assert isinstance(await anext(parts), ResponseStart) and await anext(parts) == b"a"
                waiting = asyncio.create_task(anext(parts))  # the relay waits for the worker's next part
                while len(writers) <= number:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.001)
                writers[number].write(b"1\r\nb\r\n")  # readable at the loop's next poll ...
                waiting.cancel()  # ... and cancelled before it, as a disconnect does
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                await parts.aclose()
                await asyncio.sleep(0.001)
        return errors

    assert uvloop.run(run()) == []
