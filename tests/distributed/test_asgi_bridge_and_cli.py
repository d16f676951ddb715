"""The ASGI bridge replicas answer through (a real FastAPI app: status, headers, a streamed body, an app that fails,
a client that goes away mid-stream), and the scale-out options' bad input on the command line: one line, exit 2,
nothing started (in this process; unreachable clusters in real subprocesses, which need Ray installed), and
how the front merges the replicas' cache statistics."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart, stream_asgi
from hypic_rag.distributed.front import chat_keys, completion_keys, merge_cache_stats, merge_metrics
from hypic_rag.testing import free_port

ROOT = Path(__file__).resolve().parents[2]


def bridge_app(seen: dict[str, object]) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query}, status_code=201, headers={"x-one": "1"})

    @app.get("/stream")
    async def stream(request: Request) -> StreamingResponse:
        async def parts():
            number = 0
            try:  # Starlette stops the body when it hears the disconnect (cancelled, or seen here)
                for number in range(1000):
                    if await request.is_disconnected():
                        return
                    yield f"part {number}\n"
                    await asyncio.sleep(0.01)
            finally:
                seen["stopped_at"] = number

        return StreamingResponse(parts(), media_type="text/plain")

    @app.get("/fail")
    async def fail() -> None:
        raise RuntimeError("boom")

    return app


def collect(app: FastAPI, request: ForwardedRequest, limit: int | None = None) -> list[ResponseStart | bytes]:
    async def run() -> list[ResponseStart | bytes]:
        parts = []
        stream = stream_asgi(app, request)
        async for part in stream:
            parts.append(part)
            if limit is not None and len(parts) >= limit:
                break
        await stream.aclose()
        await asyncio.sleep(0.2)  # the app notices the disconnect
        return parts

    return asyncio.run(run())


def test_a_request_comes_back_with_status_headers_and_body() -> None:
    parts = collect(bridge_app({}), ForwardedRequest("POST", "/echo", b"a=1", ((b"content-type", b"application/json"),),
                                                     b'{"x": [1, 2]}'))
    start, body = parts[0], b"".join(part for part in parts[1:] if isinstance(part, bytes))
    assert isinstance(start, ResponseStart) and start.status == 201 and (b"x-one", b"1") in start.headers
    assert body == b'{"got":{"x":[1,2]},"query":"a=1"}'


def test_a_stream_comes_in_parts_and_a_consumer_that_leaves_stops_it() -> None:
    seen: dict[str, object] = {}
    parts = collect(bridge_app(seen), ForwardedRequest("GET", "/stream"), limit=4)
    assert [part for part in parts[1:]] == [b"part 0\n", b"part 1\n", b"part 2\n"]
    assert seen.get("stopped_at") is not None and int(seen["stopped_at"]) < 50  # not the 1000 parts


def test_an_application_error_is_a_500() -> None:
    parts = collect(bridge_app({}), ForwardedRequest("GET", "/fail"))
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 500

    async def raises_before_answering(scope, receive, send) -> None:  # noqa: ANN001 - a bare ASGI app
        raise RuntimeError("boom")

    parts = collect(raises_before_answering, ForwardedRequest("GET", "/"))  # type: ignore[arg-type]
    assert isinstance(parts[0], ResponseStart) and parts[0].status == 500
    assert b'"code": "internal_error"' in b"".join(part for part in parts[1:] if isinstance(part, bytes))


def test_affinity_keys_of_completions_and_chats() -> None:
    prompt = "A.<<PIC_SEP>>B.<<PIC_SEP>>question"
    assert completion_keys({"prompt": prompt}, "<<PIC_SEP>>") == completion_keys({"prompt": [prompt]}, "<<PIC_SEP>>")
    assert len(completion_keys({"prompt": prompt}, "<<PIC_SEP>>")) == 2  # the query is no key
    assert completion_keys({"prompt": "A.|q", "separator": "|"}, "<<PIC_SEP>>") == \
        completion_keys({"prompt": prompt}, "<<PIC_SEP>>")[:1]
    assert completion_keys({"prompt": [1, 2, 3]}, "<<PIC_SEP>>") == []
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "A."}, {"type": "text", "text": "q"}]}]}
    assert chat_keys(chat, "<<PIC_SEP>>") == completion_keys({"prompt": prompt}, "<<PIC_SEP>>")[:1]


def start_cli(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    return subprocess.Popen([sys.executable, "-m", "hypic_rag", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def assert_one_line(code: int, output: str, command: str, fragment: str) -> None:
    output = output.strip()
    assert code == 2, output
    assert len(output.splitlines()) == 1 and output.startswith(f"hypic-rag {command}: error: "), output
    assert fragment in output, output


def test_scale_out_options_refused_in_one_line(tmp_path: Path, copy_tiny_index,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before anything starts (the command line in this process: nothing here reaches Ray)."""
    from hypic_rag.cli.main import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text.\n")
    index = tmp_path / "index"

    def refused(argv: list[str], fragment: str) -> None:
        code = main(argv)
        captured = capsys.readouterr()
        assert_one_line(code, captured.out + captured.err, argv[0], fragment)

    refused(["precompute", str(corpus), "--index", str(index), "--workers", "2", "--ray"],
            "--workers and --ray exclude each other")
    refused(["precompute", str(corpus), "--index", str(index), "--ray-actors", "2"], "--ray-actors needs --ray")
    assert not index.exists()
    served = copy_tiny_index(tmp_path / "served")
    refused(["serve", "--index", str(served), "--port", "0", "--workers", "1", "--cache", str(tmp_path / "c" / "{replica}")],
            "{replica} names a directory per replica and needs --replicas N or --workers N (N > 1)")
    refused(["serve", "--index", str(served), "--port", "0", "--workers", "2", "--replicas", "2"],
            "--workers N runs the model in N processes on this host and --replicas N on Ray Serve; choose one")
    (tmp_path / "a-file").write_text("x")
    refused(["serve", "--index", str(served), "--port", "0", "--cache", str(tmp_path / "a-file")],
            "segment cache directory unusable")


def test_unreachable_clusters_are_one_line(tmp_path: Path, copy_tiny_index) -> None:
    """Real subprocesses (this process may be connected to the session's cluster already), run side by side."""
    pytest.importorskip("ray", reason="ray is not installed")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Some text.\n")
    closed = f"127.0.0.1:{free_port()}"
    index = copy_tiny_index(tmp_path / "index")
    precomputing = start_cli("precompute", str(corpus), "--index", str(tmp_path / "i"), "--ray", closed)
    serving = start_cli("serve", "--index", str(index), "--port", "0", "--replicas", "2", "--ray", closed,
                        "--log-level", "warning")
    for process, command, fragment in ((precomputing, "precompute", f"cannot reach the Ray cluster at '{closed}'"),
                                       (serving, "serve", "cannot reach the Ray cluster")):
        out, err = process.communicate(timeout=180)
        assert_one_line(process.returncode, out + err, command, fragment)
    assert not (tmp_path / "i").exists()


def test_replicas_stats_merge_per_process_and_per_store_counters() -> None:
    shared = {"path": "/c", "entries": 10, "hits": 6, "misses": 2, "hit_rate": 0.75, "hot_hits": 3, "disk_hits": 1,
              "remote_url": "s3://b/p", "remote_hits": 2, "remote_available": True, "remote_last_error": ""}
    other = dict(shared, hot_hits=5, remote_hits=1, remote_available=False, remote_last_error="down")
    merged = merge_cache_stats([shared, other])  # one store shared by both replicas: its counters once
    assert (merged["entries"], merged["hits"], merged["hot_hits"], merged["remote_hits"]) == (10, 6, 8, 3)
    assert merged["remote_available"] is False and merged["remote_last_error"] == "down" and "paths" not in merged
    merged = merge_cache_stats([shared, dict(other, path="/d", entries=4, hits=0, misses=2)])  # a store each
    assert (merged["entries"], merged["hits"], merged["misses"], merged["hit_rate"]) == (14, 6, 4, 0.6)
    assert merged["paths"] == ["/c", "/d"] and merged["remote_url"] == "s3://b/p"
    assert merge_cache_stats([]) == {}


def replica_metrics(requests: int, entries: float, up: float, durations: list[float]) -> str:
    """One replica's Prometheus text, from a real registry of the kinds the service exports."""
    registry = CollectorRegistry()
    served = Counter("hypic_requests", "HTTP requests answered", ["route", "status"], registry=registry)
    served.labels(route='/v1/ask "x"', status="200").inc(requests)
    Gauge("hypic_segment_cache_entries", "Entries in the persistent segment cache.", registry=registry).set(entries)
    Gauge("hypic_segment_cache_remote_up", "1 when the remote tier answers.", registry=registry).set(up)
    Gauge("hypic_queue_depth", "Requests waiting.", registry=registry).set(requests)
    duration = Histogram("hypic_request_duration_seconds", "time", buckets=(0.1, 1.0), registry=registry)
    for seconds in durations:
        duration.observe(seconds)
    return generate_latest(registry).decode()


def test_workers_metrics_merge_into_one_servers() -> None:
    merged = merge_metrics([replica_metrics(3, 10, 1, [0.05, 2.0]), replica_metrics(4, 10, 0, [0.5])])
    values = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
              for family in text_string_to_metric_families(merged) for sample in family.samples}
    assert values[("hypic_requests_total", (("route", '/v1/ask "x"'), ("status", "200")))] == 7  # summed, label kept
    assert values[("hypic_queue_depth", ())] == 7
    assert values[("hypic_segment_cache_entries", ())] == 10  # one store both read: not doubled
    assert values[("hypic_segment_cache_remote_up", ())] == 0  # down for one replica: down
    buckets = {dict(labels)["le"]: value for (name, labels), value in values.items()
               if name == "hypic_request_duration_seconds_bucket"}
    assert buckets == {"0.1": 1, "1.0": 2, "+Inf": 3}
    assert values[("hypic_request_duration_seconds_count", ())] == 3
    assert merged.count("# TYPE hypic_requests_total counter") == 1 and merged.count("# TYPE") == len(
        list(text_string_to_metric_families(replica_metrics(1, 1, 1, []))))
    assert merge_metrics([]) == ""


def test_malformed_addresses_are_refused_before_any_connection() -> None:
    from hypic_rag.distributed.cluster import ClusterConfig, RayUnavailableError, check_reachable

    for address in ("no-port", "host:", "ray://:80"):
        with pytest.raises(RayUnavailableError, match="not a Ray address"):
            check_reachable(address)
    with pytest.raises(ValueError):
        ClusterConfig(address=" ")


class AppReplica:
    """A `front.ReplicaClient` over an in-process ASGI application (as a Ray replica runs one)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def stream(self, request: ForwardedRequest):
        return stream_asgi(self.app, request)


def jobs_replica(name: str, state: dict[str, object]) -> FastAPI:
    """A replica that queues document jobs as the service does (202; `pending_jobs` in its `/healthz`, which counts
    each poll and answers `health_status`), and answers questions, holding one whose body asks to wait."""
    app = FastAPI()

    @app.post("/v1/documents")
    async def add() -> JSONResponse:
        state["pending"] = int(state["pending"]) + 1
        return JSONResponse({"job_id": "j"}, status_code=202)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        state["polls"] = int(state["polls"]) + 1
        return JSONResponse({"pending_jobs": state["pending"]}, status_code=int(state["health_status"]))

    @app.post("/v1/ask")
    @app.post("/v1/completions")
    async def ask(request: Request) -> JSONResponse:
        if (await request.json()).get("wait"):
            await state["release"].wait()
        return JSONResponse({"replica": name})

    return app


def test_the_front_passes_over_the_owner_while_its_document_jobs_are_pending(tmp_path: Path) -> None:
    """Over in-process replicas: a 202 from the owner's document route makes questions go to the other replica
    (also when their segments point at the owner); with the other at its in-flight limit or unreachable they reach
    the owner (200, never 503); once the owner's `/healthz` counts no pending job, or cannot answer (restarting),
    it takes questions again; its `/healthz` is asked only while it is busy. A front without an owner (Ray
    replicas) never marks one."""
    import httpx

    from hypic_rag.distributed.front import Front, create_front_app
    from hypic_rag.distributed.local_workers import WorkerClient
    from hypic_rag.distributed.rendezvous import RendezvousRouter
    from hypic_rag.server import ServerConfig

    config = ServerConfig(index_dir=tmp_path)
    owner_state = {"pending": 0, "polls": 0, "health_status": 200, "release": None}
    other_state = dict(owner_state)
    prompt = next(f"Segment {number}.<<PIC_SEP>>A question?" for number in range(100)
                  if RendezvousRouter(["worker-0", "worker-1"]).ranking(
                      completion_keys({"prompt": f"Segment {number}.<<PIC_SEP>>A question?"}, "<<PIC_SEP>>"))[0]
                  == "worker-0")  # a prompt whose segment belongs to the owner

    async def until(condition, what: str) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{what} did not happen within 500 checks")

    async def run() -> None:
        owner_state["release"] = other_state["release"] = asyncio.Event()
        front = Front(config, {"worker-0": AppReplica(jobs_replica("worker-0", owner_state)),
                               "worker-1": AppReplica(jobs_replica("worker-1", other_state))},
                      retrieve=None, owner="worker-0", max_in_flight=1, owner_jobs_poll_s=0.01)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_front_app(front)), base_url="http://front")

        async def served_by(path: str = "/v1/ask", body: dict | None = None) -> str:
            response = await client.post(path, json=body or {"question": "q"})
            assert response.status_code == 200, response.text
            return response.headers["x-hypic-replica"]

        assert await served_by() == "worker-0" and owner_state["polls"] == 0  # idle: the tie goes to worker-0
        assert (await client.post("/v1/documents", json={})).status_code == 202
        assert front.owner_busy
        assert [await served_by() for _ in range(3)] == ["worker-1"] * 3
        metrics = (await client.get("/metrics")).text
        assert "hypic_front_owner_busy 1" in metrics, metrics

        held = asyncio.create_task(served_by(body={"question": "q", "wait": True}))  # worker-1 at its limit (1)
        await until(lambda: front.router.snapshot()["in_flight"]["worker-1"] == 1, "the held question's routing")
        assert await served_by() == "worker-0"  # still answered: by the owner, its jobs notwithstanding
        owner_state["release"].set()
        assert await held == "worker-1"

        owner_state["pending"] = 0  # the owner's job finished
        await until(lambda: not front.owner_busy, "the owner's release")
        polls = owner_state["polls"]
        assert polls >= 1 and await served_by() == "worker-0"
        assert await served_by("/v1/completions", {"prompt": prompt}) == "worker-0"
        await asyncio.sleep(0.2)  # twenty poll periods with nothing pending: no poll
        assert owner_state["polls"] == polls
        assert "hypic_front_owner_busy 0" in (await client.get("/metrics")).text

        assert (await client.post("/v1/documents", json={})).status_code == 202
        assert await served_by("/v1/completions", {"prompt": prompt}) == "worker-1"  # passed over, affinity too
        owner_state["health_status"] = 503  # the owner restarting: its jobs died with it
        await until(lambda: not front.owner_busy, "the release of an owner that cannot answer")
        assert await served_by() == "worker-0"
        await client.aclose()

        front = Front(config, {"worker-0": AppReplica(jobs_replica("worker-0", owner_state)),
                               "worker-1": WorkerClient("worker-1", str(tmp_path / "gone.sock"))},
                      retrieve=None, owner="worker-0", owner_jobs_poll_s=0.01)
        owner_state["health_status"] = 200
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_front_app(front)), base_url="http://front")
        assert (await client.post("/v1/documents", json={})).status_code == 202 and front.owner_busy
        assert await served_by() == "worker-0"  # the other one unreachable: taken out of rotation, the owner serves
        assert front.router.is_down("worker-1")
        await client.aclose()

        unowned = Front(config, {"replica-0": AppReplica(jobs_replica("replica-0", other_state))}, retrieve=None)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_front_app(unowned)), base_url="http://f")
        polls = other_state["polls"]
        assert (await client.post("/v1/documents", json={})).status_code == 202
        assert not unowned.owner_busy and "hypic_front_owner_busy" not in (await client.get("/metrics")).text
        await asyncio.sleep(0.1)
        assert other_state["polls"] == polls  # no owner: no poll
        await client.aclose()

    asyncio.run(run())
