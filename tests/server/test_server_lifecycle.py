"""`hypic-rag serve`: bad input exits 2; SIGTERM while requests are in flight finishes them, exits 0, releases
the index and leaves every cache entry intact (including ones written during the requests)."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.maintenance import verify_store
from hypic_rag.cli.main import main
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from hypic_rag.testing import free_port
from kits.corpora import SMALL_CORPUS_QUESTIONS

STARTUP_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("server_lifecycle") / "index")


def test_serve_without_an_index_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--index", str(tmp_path / "missing")]) == 2
    stderr = capsys.readouterr().err
    assert "hypic-rag serve: error: no index at" in stderr and "hypic-rag precompute" in stderr


def test_serve_with_a_bad_port_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--index", str(tmp_path), "--port", "70000"])
    assert exit_info.value.code == 2
    assert "argument --port: must be an integer in 0..65535, got 70000" in capsys.readouterr().err


def wait_until_ready(url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server did not become ready")


def in_flight_requests(url: str, fresh_segments: list[str]) -> list[Callable[[], httpx.Response]]:
    """Two asks (one streamed) and one completion per fresh segment (each writes a new cache entry)."""

    def ask() -> httpx.Response:
        body = {"question": SMALL_CORPUS_QUESTIONS["astronomy.md"], "max_new_tokens": 24}
        return httpx.post(f"{url}/v1/ask", json=body, timeout=120)

    def stream() -> httpx.Response:
        body = {"question": SMALL_CORPUS_QUESTIONS["chess.md"], "max_new_tokens": 24, "stream": True}
        with httpx.stream("POST", f"{url}/v1/ask", json=body, timeout=120) as response:
            response.read()
        return response

    def complete(segment: str) -> Callable[[], httpx.Response]:
        body = {"prompt": f"{segment}<<PIC_SEP>>Which cranes?", "max_tokens": 24, "temperature": 0}
        return lambda: httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    return [ask, stream] + [complete(segment) for segment in fresh_segments]


def test_sigterm_finishes_in_flight_requests_and_leaves_the_cache_consistent(index: Path) -> None:
    """`hypic-rag serve` runs here in the main thread (where uvicorn takes SIGTERM); a driver thread sends
    requests, waits until the server holds them all, and sends SIGTERM to this process."""
    cache_dir = index / "segment_cache"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    fresh_segments = [f"Fresh segment number {n} about harbour cranes." for n in range(3)]
    outcome: dict[str, object] = {}

    def drive() -> None:
        try:
            wait_until_ready(url)
            outcome["entries_before"] = httpx.get(f"{url}/v1/cache/stats", timeout=60).json()["cache"]["entries"]
            calls = in_flight_requests(url, fresh_segments)
            with ThreadPoolExecutor(max_workers=len(calls)) as pool:
                futures = [pool.submit(call) for call in calls]
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:  # until the server holds every request not yet answered
                    depth = httpx.get(f"{url}/healthz", timeout=5).json()["queue_depth"]
                    if depth + sum(f.done() for f in futures) == len(futures):
                        break
                    time.sleep(0.01)
                outcome["pending_at_signal"] = sum(not f.done() for f in futures)
                os.kill(os.getpid(), signal.SIGTERM)
                outcome["responses"] = [future.result(timeout=180) for future in futures]
        except BaseException as error:  # reported by the test below
            outcome["error"] = error
            os.kill(os.getpid(), signal.SIGTERM)

    driver = threading.Thread(target=drive, name="lifecycle-driver")
    driver.start()
    exit_code = main(["serve", "--index", str(index), "--port", str(port), "--log-level", "warning"])
    driver.join(timeout=240)
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    assert exit_code == 0
    assert outcome["pending_at_signal"] >= 2, "too few requests were in flight at the signal to test anything"
    responses: list[httpx.Response] = outcome["responses"]  # type: ignore[assignment]
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text[:200] for r in responses]
    assert responses[0].json()["sources"][0]["doc_id"] == "astronomy.md"
    assert responses[1].text.rstrip().endswith("data: [DONE]") and '"type":"done"' in responses[1].text
    for response in responses[2:]:
        assert response.json()["usage"]["cache_misses"] == 1
    # the cache is closed cleanly and whole: every entry verifies, the ones written in flight are there
    store = LmdbSegmentStore.open(cache_dir, readonly=True)
    try:
        report = verify_store(store)
    finally:
        store.close()
    assert report.problems == []
    assert report.checked == outcome["entries_before"] + len(fresh_segments)
    with (index / "index.lock").open("a+") as lock:  # the writer lock is released
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_read_only_server_answers_but_refuses_document_changes(index: Path) -> None:
    with ServerThread(ServerConfig(index_dir=index, device="cpu", read_only=True)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            assert client.get("/healthz").json()["read_only"] is True
            answer = client.post("/v1/ask", json={"question": SMALL_CORPUS_QUESTIONS["lavender.md"],
                                                  "max_new_tokens": 3})
            assert answer.status_code == 200 and answer.json()["sources"][0]["doc_id"] == "lavender.md"
            added = client.post("/v1/documents", json={"documents": [{"id": "x", "text": "Some text."}]})
            assert added.status_code == 409 and "read-only" in added.json()["error"]["message"]
            assert client.delete("/v1/documents/lavender.md").status_code == 409
        with (index / "index.lock").open("a+") as lock:  # a read-only server leaves the writer lock free
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
