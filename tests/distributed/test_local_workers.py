"""`hypic-rag serve --workers 2 --read-only`: one real subprocess whose two spawned workers serve the tiny index
behind the front on 127.0.0.1. Concurrent answers equal the same questions asked one at a time, both workers serve (routed by
load), streams arrive whole, the index is read-only (409), the front checks the API key (from the environment) and
refuses a body nested 100,000 deep with 400 (it was a 500 with a RecursionError), a worker killed with SIGKILL under
load leaves the rotation at once (its requests go to the other; it was 214 failures over 3.2 s) with a few log
lines (it was one ERROR per refused request), is restarted and serves again, and SIGTERM stops the server and every
worker. Plus the pieces in this process: the thread split and the one-line refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import httpx
import pytest

from hypic_rag.distributed.local_workers import worker_names, worker_threads
from hypic_rag.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What does the corpus say about the river?", "Who built the bridge?", "When was the town founded?",
             "What is the harbour known for?"]


def children(pid: int) -> list[int]:
    """Every child of `pid`, whichever of its threads started it (a restarted worker: the watch thread)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def worker_pids(pid: int) -> list[int]:
    """The server's spawned worker processes (not its watchdog or multiprocessing's resource tracker)."""
    pids = []
    for child in children(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"multiprocessing" in command and b"spawn_main" in command:
            pids.append(child)
    return pids


def wait_healthy(url: str, process: subprocess.Popen[str], timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        try:
            response = httpx.get(f"{url}/healthz", timeout=10)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server did not become healthy")


API_KEY = "sk-workers-5e1f0c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def ask(url: str, question: str) -> tuple[str, tuple[str, ...], str]:
    response = httpx.post(f"{url}/v1/ask", json={"question": question, "top_k": 2, "max_new_tokens": 6},
                          headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    return body["answer"], tuple(source["chunk_id"] for source in body["sources"]), response.headers["x-hypic-replica"]


def start_serve(index: Path, port: int, *options: str, **keys: str) -> subprocess.Popen[str]:
    """`hypic-rag serve` over `index` on 127.0.0.1:`port` in a subprocess (keys: environment variables to set)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **keys}
    return subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port", str(port), "--device", "cpu",
         *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )


def two_workers_up(url: str, process: subprocess.Popen[str], *, read_only: bool) -> tuple[dict, list[int]]:
    """Once the server is healthy: its /healthz (both workers listed, `read_only` as expected) and the workers' pids."""
    health = wait_healthy(url, process)
    assert [replica["replica"] for replica in health["replicas"]] == worker_names(2)
    assert health["read_only"] is read_only
    pids = worker_pids(process.pid)
    assert len(pids) == 2
    return health, pids


def answers_alike(url: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every question asked alone, then 16 at once from 8 threads: the same answers and sources, from both workers;
    returns the answers alone."""
    alone = [ask(url, question)[:2] for question in QUESTIONS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda number: ask(url, QUESTIONS[number % 4]), range(16)))
    assert [answer[:2] for answer in together] == [alone[number % 4] for number in range(16)]
    assert {answer[2] for answer in together} == set(worker_names(2))  # routed by load: both served
    return alone


def assert_stopped_cleanly(process: subprocess.Popen[str], err: str, running: list[int]) -> None:
    """After SIGTERM: the server exited 0 without a traceback, and none of its `running` workers is left."""
    assert process.returncode == 0, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert not [pid for pid in running if Path(f"/proc/{pid}").exists()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_workers_serve_equal_answers_restart_and_stop(tmp_path: Path, copy_tiny_index) -> None:
    index = copy_tiny_index(tmp_path / "index")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve(index, port, "--workers", "2", "--read-only", "--log-level", "warning",
                          HYPIC_RAG_API_KEY=API_KEY)
    try:
        health, pids = two_workers_up(url, process, read_only=True)
        alone = answers_alike(url)

        with httpx.stream("POST", f"{url}/v1/ask", json={"question": QUESTIONS[0], "top_k": 2, "max_new_tokens": 6,
                                                         "stream": True}, headers=AUTH, timeout=120) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert events[-1]["type"] == "done" and events[-1]["answer"] == alone[0][0]

        refused = httpx.post(f"{url}/v1/documents", json={"documents": [{"id": "new", "text": "More text."}]},
                             headers=AUTH, timeout=60)
        assert refused.status_code == 409, refused.text
        for path in ("/v1/ask", "/v1/completions", "/v1/cache/stats"):  # the front checks the key
            unkeyed = httpx.request("GET" if path.endswith("stats") else "POST", f"{url}{path}", json={}, timeout=60)
            assert unkeyed.status_code == 401 and unkeyed.json()["error"]["code"] == "missing_api_key", unkeyed.text
        deep = ("[" * 100_000 + "]" * 100_000).encode()
        for path in ("/v1/completions", "/v1/chat/completions"):
            nested = httpx.post(f"{url}{path}", content=deep, headers={**AUTH, "content-type": "application/json"},
                                timeout=60)
            assert nested.status_code == 400 and nested.json()["error"]["code"] == "invalid_json", nested.text

        def ask_status(number: int) -> int:
            if number == 8:
                os.kill(pids[0], signal.SIGKILL)  # a crash under load: the other worker takes its requests
            return httpx.post(f"{url}/v1/ask", json={"question": QUESTIONS[number % 4], "top_k": 2,
                                                     "max_new_tokens": 6}, headers=AUTH, timeout=120).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(ask_status, range(40)))
        failed = [status for status in statuses if status != 200]
        assert len(failed) <= 2, statuses  # requests that never got an answer are sent to the live worker
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            restarted = [pid for pid in worker_pids(process.pid) if pid not in pids]
            if restarted and httpx.get(f"{url}/healthz", timeout=10).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the killed worker was not restarted")
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda number: ask(url, QUESTIONS[number % 4]), range(8)))
        assert [answer[:2] for answer in again] == [alone[number % 4] for number in range(8)]
        running = worker_pids(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    assert_stopped_cleanly(process, err, running)
    assert len([line for line in err.splitlines() if "worker-0" in line]) <= 4, err[-3000:]  # once per event
    assert API_KEY not in out + err


def test_workers_share_the_cores() -> None:
    assert worker_threads(2, cores=2) == 1
    assert worker_threads(3, cores=2) == 1
    assert worker_threads(2, cores=16) == 8
    assert worker_threads(1, cores=4) == 4


WRITE_KEY = "sk-workers-admin-9d3a7e"
WRITES = {"Authorization": f"Bearer {WRITE_KEY}"}
NEW_TEXT = ("Zorblat Quimby is a quasar cartographer who lives in Vintermoor. Zorblat Quimby draws maps of quasars "
            "and keeps blue teapots in the Vintermoor observatory.")
NEW_QUESTION = "Who is Zorblat Quimby, the quasar cartographer of Vintermoor?"


def owner_pid(pids: list[int], index: Path) -> int:
    """The worker holding the index's writer lock open (worker-0, the owner)."""
    lock = str((index / "index.lock").resolve())
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) == lock:
                    return pid
            except OSError:
                continue
    raise AssertionError("no worker holds the index's writer lock")


def ask_workers(url: str, body: dict, path: str = "/v1/ask", count: int = 16) -> list[tuple[list[str], str]]:
    """`count` requests from 8 threads at once: (the doc ids of each response's sources, the worker that answered)."""

    def one(_: int) -> tuple[list[str], str]:
        response = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        return [source["doc_id"] for source in response.json()["sources"]], response.headers["x-hypic-replica"]

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def wait_indexed(url: str, accepted: httpx.Response, documents: int, timeout_s: float = 120.0) -> dict:
    assert accepted.status_code == 202, accepted.text
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}{accepted.json()['status_url']}", headers=WRITES, timeout=30).json()
        if job["status"] == "failed" or job["progress"]["documents_indexed"] >= documents:
            return job
        time.sleep(0.1)
    raise TimeoutError("the document job did not index its documents")


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="reads /proc; the default runs a worker per core, so it needs 2")
def test_the_bare_command_serves_a_writable_index_from_a_worker_per_core(tmp_path: Path, copy_tiny_index) -> None:
    """Bare `serve` on 2 cores with a small model: 2 workers over a writable index. Concurrent answers equal those
    asked alone; a document written through the front (the write key) is found by every worker once its job says
    it is indexed, through /v1/ask, its stream and chat over the index, and a delete likewise; the API key alone
    and a wrong key are refused; SIGKILL of the owner in the middle of a document job loses nothing written before
    and corrupts nothing (the cache verifies, the docstore and FAISS agree), and the restarted owner takes writes."""
    from hypic_rag.cache.lmdb_store import LmdbSegmentStore
    from hypic_rag.cache.maintenance import verify_store
    from hypic_rag.retrieval.corpus_index import VECTORS_FILE, CorpusIndex
    from hypic_rag.retrieval.faiss_index import VectorIndex

    index = copy_tiny_index(tmp_path / "index")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve(index, port, HYPIC_RAG_API_KEY=API_KEY, HYPIC_RAG_ADMIN_KEY=WRITE_KEY)  # bare
    try:
        health, pids = two_workers_up(url, process, read_only=False)
        alone = answers_alike(url)

        document = {"documents": [{"id": "zorblat.md", "text": NEW_TEXT}]}
        for headers, status in ((AUTH, 403), ({"Authorization": "Bearer sk-wrong-key-000000"}, 401), ({}, 401)):
            refused = httpx.post(f"{url}/v1/documents", json=document, headers=headers, timeout=30)
            assert refused.status_code == status and refused.json()["error"]["message"], refused.text
        before = httpx.get(f"{url}/v1/documents", headers=AUTH, timeout=30).json()
        assert before["total"] == health["documents"] and before["read_only"] is False

        job = wait_indexed(url, httpx.post(f"{url}/v1/documents", json=document, headers=WRITES, timeout=30), 1)
        assert job["status"] != "failed", job
        asked = {"question": NEW_QUESTION, "top_k": 2, "max_new_tokens": 4}
        found = ask_workers(url, asked)
        assert all("zorblat.md" in sources for sources, _ in found), found
        assert {worker for _, worker in found} == set(worker_names(2))  # every worker sees the write

        def stream_sources(_: int) -> tuple[list[str], str]:
            with httpx.stream("POST", f"{url}/v1/ask", json={**asked, "stream": True}, headers=AUTH,
                              timeout=120) as response:
                events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
                worker = response.headers["x-hypic-replica"]
            assert events[-1]["type"] == "done", events
            return [source["doc_id"] for event in events if event["type"] == "sources"
                    for source in event["sources"]], worker

        with ThreadPoolExecutor(8) as pool:
            streams = list(pool.map(stream_sources, range(16)))
        assert all("zorblat.md" in sources for sources, _ in streams), streams
        model = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
        chats = ask_workers(url, {"model": f"{model}+index", "temperature": 0, "max_tokens": 4,
                                  "messages": [{"role": "user", "content": NEW_QUESTION}]}, "/v1/chat/completions")
        assert all("zorblat.md" in sources for sources, _ in chats), chats
        assert {worker for _, worker in streams + chats} == set(worker_names(2))

        deleted = httpx.delete(f"{url}/v1/documents/zorblat.md", headers=WRITES, timeout=30)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        gone = ask_workers(url, asked)
        assert not any("zorblat.md" in sources for sources, _ in gone) and len({w for _, w in gone}) == 2, gone

        owner = owner_pid(pids, index)
        many = {"documents": [{"id": f"bulk-{number}.md", "text": f"{NEW_TEXT} Entry {number}. " * 12}
                              for number in range(40)]}
        accepted = httpx.post(f"{url}/v1/documents", json=many, headers=WRITES, timeout=30)
        assert accepted.status_code == 202, accepted.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill the owner while its job writes the index and the cache
            state = httpx.get(f"{url}{accepted.json()['status_url']}", headers=WRITES, timeout=30).json()
            if state["status"] != "queued":
                break
            time.sleep(0.02)
        os.kill(owner, signal.SIGKILL)
        during = httpx.post(f"{url}/v1/ask", json={"question": QUESTIONS[0], "top_k": 2, "max_new_tokens": 6},
                            headers=AUTH, timeout=120)
        assert during.status_code == 200 and during.json()["answer"] == alone[0][0], during.text  # worker-1 answers
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if owner not in worker_pids(process.pid) and httpx.get(f"{url}/healthz", timeout=10).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the killed owner was not restarted")
        job = wait_indexed(url, httpx.post(f"{url}/v1/documents", json=document, headers=WRITES, timeout=30), 1)
        assert job["status"] != "failed", job
        found = ask_workers(url, asked)
        assert all("zorblat.md" in sources for sources, _ in found) and len({w for _, w in found}) == 2, found
        answers_alike(url)  # the index holds the documents written since: every worker answers alike
        running = worker_pids(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    assert_stopped_cleanly(process, err, running)
    assert "serve: 2 worker processes x 1 intra-op thread (2 cores" in err, err[-3000:]
    assert WRITE_KEY not in out + err and API_KEY not in out + err
    with CorpusIndex.open(index) as reopened:  # nothing the owner wrote before its death is lost or half-written
        assert reopened.docstore._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        live = sorted(reopened.docstore.live_vector_ids().tolist())
        on_disk = VectorIndex.load(index / VECTORS_FILE, reopened.manifest.embedder.dimension,
                                   reopened.manifest.vector_index)  # the file, as saved: no repair pending
        assert sorted(on_disk.live_ids().tolist()) == live
        counts = reopened.counts()
        assert reopened.manifest.counts == {"documents": counts.documents, "chunks": counts.chunks,
                                            "tokens": counts.tokens}
        assert "zorblat.md" in reopened.docstore.document_digests()
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        report = verify_store(store)
        assert report.checked > 0 and not report.problems, report.problems


TERMINAL = ("succeeded", "failed", "cancelled")


def job_status(url: str, accepted: httpx.Response) -> str:
    response = httpx.get(f"{url}{accepted.json()['status_url']}", headers=WRITES, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["status"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, stops a worker with SIGSTOP")
def test_questions_pass_over_the_owner_while_its_document_job_runs(tmp_path: Path, copy_tiny_index) -> None:
    """`serve --workers 2` over a writable index: while the owner (worker-0) has a document job, questions (ask and
    completions, whose segments point at the owner) are answered by worker-1 and the job completes under them
    (without the routing the owner answered them, its job getting a fifth of its model worker's time); with
    worker-1 stopped and at its in-flight limit, a question still reaches the owner (200); once the job is done
    the owner answers questions again."""
    from hypic_rag.distributed.front import completion_keys
    from hypic_rag.distributed.rendezvous import RendezvousRouter
    from hypic_rag.prompting.segments import DEFAULT_SEPARATOR

    index = copy_tiny_index(tmp_path / "index")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve(index, port, "--workers", "2", "--max-in-flight", "2", "--log-level", "warning",
                          HYPIC_RAG_API_KEY=API_KEY, HYPIC_RAG_ADMIN_KEY=WRITE_KEY)
    prompts = (f"The ferry leaves at {hour}.{DEFAULT_SEPARATOR}When does the ferry leave?" for hour in range(99))
    prompt = next(text for text in prompts if RendezvousRouter(worker_names(2)).ranking(
        completion_keys({"prompt": text}, DEFAULT_SEPARATOR))[0] == "worker-0")  # its segment's affinity: the owner
    questions = [("/v1/ask", {"question": QUESTIONS[0], "top_k": 2, "max_new_tokens": 4}),
                 ("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})]

    def served_by(number: int) -> str:
        path, body = questions[number % 2]
        response = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)
        assert response.status_code == 200, response.text
        return response.headers["x-hypic-replica"]

    def many(batch: int) -> dict:
        return {"documents": [{"id": f"bulk-{batch}-{number}.md", "text": f"{NEW_TEXT} Entry {batch}.{number}. " * 12}
                              for number in range(40)]}

    try:
        _, pids = two_workers_up(url, process, read_only=False)
        assert [served_by(number) for number in range(2)] == ["worker-0", "worker-0"]  # idle: ties and affinity
        accepted = httpx.post(f"{url}/v1/documents", json=many(0), headers=WRITES, timeout=30)
        assert accepted.status_code == 202, accepted.text
        answered: list[tuple[str, str]] = []  # (the worker that answered, the job's status after the answer)
        while not answered or answered[-1][1] not in TERMINAL:
            assert len(answered) < 400, f"the job did not end under 400 questions: {answered[-5:]}"
            answered.append((served_by(len(answered)), job_status(url, accepted)))
        during = [worker for worker, status in answered if status not in TERMINAL]
        assert during, "the job ended before the first question was answered: give it more documents"
        assert set(during) == {"worker-1"}, answered  # the owner ran its job meanwhile
        assert answered[-1][1] == "succeeded", answered[-1]

        for number in range(50):  # the front learns the job ended from the owner's /healthz (a poll away)
            if served_by(number) == "worker-0":
                break
        else:
            raise AssertionError("50 questions after the job ended, none reached the owner")

        other = next(pid for pid in pids if pid != owner_pid(pids, index))
        accepted = httpx.post(f"{url}/v1/documents", json=many(1), headers=WRITES, timeout=30)
        assert accepted.status_code == 202, accepted.text
        os.kill(other, signal.SIGSTOP)  # worker-1 takes its 2 (its limit), then holds them
        try:
            with ThreadPoolExecutor(3) as pool:
                held = [pool.submit(served_by, 0) for _ in range(3)]
                first = next(as_completed(held, timeout=120)).result()
                busy = job_status(url, accepted)
                os.kill(other, signal.SIGCONT)
                workers = sorted(future.result(timeout=120) for future in held)
        finally:
            os.kill(other, signal.SIGCONT)
        assert busy not in TERMINAL, "the job ended before worker-1 was full: give it more documents"
        assert first == "worker-0" and workers == ["worker-0", "worker-1", "worker-1"], workers
        running = worker_pids(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    assert_stopped_cleanly(process, err, running)
