"""A document job advances while questions keep the model busy, against a real server on 127.0.0.1 (tiny model).

Client threads ask streamed questions without pause, so the scheduler always has sequences generating; a
`POST /v1/documents` job sent meanwhile still succeeds (the model worker gives background jobs a bounded share of
its time, `worker.JOB_SHARE`; before, a job stepped only when nothing was queued or generating and waited for as
long as the questions went on), and every question answered meanwhile gets what it gets asked alone.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS

ASKING_CLIENTS = 4
JOB_BOUND_S = 60.0
"""How long the job may take under the questions before the test fails (it takes a few seconds here)."""
QUESTIONS_BOUND = 2_000
"""How many questions the clients may ask in all before the test fails (a few hundred here)."""
NEW_DOCUMENTS = [
    {"id": f"freight/ledger-{number}.md",
     "text": " ".join(f"Freight ledger {number}, entry {line}: {line + 3} tonnes of copper wire shipped by barge "
                      f"under tariff code {line * 7}, invoiced in arrears." for line in range(6))}
    for number in range(2)
]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("server_jobs_under_questions") / "index")


def ask_streamed(client: httpx.Client, body: dict) -> tuple[str, str, str, list[str]]:
    """(streamed text, final answer, finish reason, source chunk ids) of a streamed ask."""
    with client.stream("POST", "/v1/ask", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read().decode()
        frames = response.read().decode().strip().split("\n\n")
    assert frames[-1] == "data: [DONE]", frames[-1]
    events = [json.loads(frame[len("data: "):]) for frame in frames[:-1]]
    done = events[-1]
    assert done["type"] == "done", done
    sources = [source["chunk_id"] for event in events if event["type"] == "sources" for source in event["sources"]]
    text = "".join(event["text"] for event in events if event["type"] == "token")
    return text, done["answer"], done["finish_reason"], sources


def test_a_document_job_succeeds_while_questions_keep_the_model_busy(index: Path) -> None:
    questions = list(SMALL_CORPUS_QUESTIONS.values())
    # different lengths, so the clients' answers end at different steps and the batch never runs empty
    bodies = [{"question": questions[number % len(questions)], "top_k": 1, "max_new_tokens": 40 + 7 * number}
              for number in range(ASKING_CLIENTS)]
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as server, \
            httpx.Client(base_url=server.url, timeout=120) as client:
        alone = [ask_streamed(client, body) for body in bodies]
        worker = server.app.state.service.worker
        stop = threading.Event()
        answered: list[tuple[int, tuple[str, str, str, list[str]]]] = []
        errors: list[BaseException] = []

        def keep_asking(number: int) -> None:
            try:
                with httpx.Client(base_url=server.url, timeout=120) as own:
                    while not stop.is_set() and len(answered) < QUESTIONS_BOUND:
                        answered.append((number, ask_streamed(own, bodies[number])))
            except BaseException as error:  # reported by the test's thread
                errors.append(error)
                stop.set()

        askers = [threading.Thread(target=keep_asking, args=(number,), daemon=True) for number in range(ASKING_CLIENTS)]
        for asker in askers:
            asker.start()
        try:
            began = time.monotonic()
            while worker.generating == 0 and not stop.is_set() and time.monotonic() - began < JOB_BOUND_S:
                time.sleep(0.005)  # the job is sent once the questions generate
            accepted = client.post("/v1/documents", json={"documents": NEW_DOCUMENTS})
            assert accepted.status_code == 202, accepted.text
            answered_before_job = len(answered)
            job = client.get(accepted.json()["status_url"]).json()
            while (job["status"] in ("queued", "running") and not stop.is_set() and len(answered) < QUESTIONS_BOUND
                   and time.monotonic() - began < JOB_BOUND_S):
                time.sleep(0.05)
                job = client.get(accepted.json()["status_url"]).json()
            answered_during_job = len(answered) - answered_before_job
        finally:
            stop.set()
            for asker in askers:
                asker.join(120)
        assert not errors, f"a question failed while the job ran: {errors[0]!r}"
        assert job["status"] == "succeeded", (
            f"the document job is still {job['status']} ({job['progress']}) after {time.monotonic() - began:.0f} s "
            f"and {len(answered)} questions: it got no share of the model worker while questions generated")
        assert answered_during_job >= ASKING_CLIENTS, "the questions did not go on while the job ran"
        for number, outcome in answered:
            assert outcome == alone[number], f"question {number} answered under the job differs from alone"
        assert job["result"]["documents_added"] == len(NEW_DOCUMENTS)
        assert job["progress"]["chunks_encoded"] == job["progress"]["chunks_total"] >= len(NEW_DOCUMENTS)
