"""The short REST path against a real uvicorn server on 127.0.0.1 (tiny model): questions waiting together are
retrieved in one batch outside the model worker and answered exactly as when asked alone; a chat whose model is the
served id plus `+index` is answered from the served index as `/v1/ask` answers it (streamed and not), with the
sources, the same cache reuse, and OpenAI's shapes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS

QUESTIONS = list(SMALL_CORPUS_QUESTIONS.values())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> ServerThread:
    index = copy_tiny_index(tmp_path_factory.mktemp("retrieval_stage") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", max_running=8,
                                   retrieval_batch=len(QUESTIONS))) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def ask(client: httpx.Client, question: str) -> dict[str, Any]:
    response = client.post("/v1/ask", json={"question": question, "top_k": 3, "max_new_tokens": 6})
    assert response.status_code == 200, response.text
    return response.json()


def ask_together(server: ServerThread, client: httpx.Client) -> tuple[dict[str, dict[str, Any]], int]:
    """Every question of QUESTIONS asked at once, the retrieval stage held until all of them wait: (answers by
    question, the batches the stage retrieved them in)."""
    service = server.app.state.service
    stage = service.retrieval
    answers: dict[str, dict[str, Any]] = {}
    with service.backend.index_lock:  # the stage cannot retrieve until every question waits
        batches_before = stage.batches
        threads = [threading.Thread(target=lambda q=question: answers.__setitem__(q, ask(client, q)))
                   for question in QUESTIONS]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while stage.waiting < len(QUESTIONS):
            assert time.monotonic() < deadline, f"only {stage.waiting} questions reached the retrieval stage"
            time.sleep(0.01)
    for thread in threads:
        thread.join(120)
    assert stage.waiting == 0 and stage.generating == 0
    assert client.get("/healthz").json()["queue_depth"] == 0
    return answers, stage.batches - batches_before


def assert_answered_as_alone(answers: dict[str, dict[str, Any]], alone: dict[str, dict[str, Any]],
                             questions: list[str] = QUESTIONS) -> None:
    for question in questions:
        mine, theirs = answers[question], alone[question]
        assert (mine["answer"], mine["finish_reason"], [s["chunk_id"] for s in mine["sources"]]) == (
            theirs["answer"], theirs["finish_reason"], [s["chunk_id"] for s in theirs["sources"]]), question
        assert mine["usage"]["completion_tokens"] == theirs["usage"]["completion_tokens"]


def test_questions_waiting_together_are_retrieved_in_one_batch_and_answered_as_alone(
    server: ServerThread, client: httpx.Client
) -> None:
    alone = {question: ask(client, question) for question in QUESTIONS}
    answers, batches = ask_together(server, client)
    # the first arrival may have been taken alone before the lock was noticed; the rest are one batch
    assert batches <= 2
    assert_answered_as_alone(answers, alone)


def test_retrieval_batches_hold_at_most_retrieval_batch_questions(
    tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, server: ServerThread, client: httpx.Client
) -> None:
    """`retrieval_batch` 2: six questions waiting together go in at least three batches, each answered as alone."""
    alone = {question: ask(client, question) for question in QUESTIONS}
    index = copy_tiny_index(tmp_path_factory.mktemp("retrieval_batch") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", max_running=8, retrieval_batch=2)) as capped:
        assert capped.app.state.service.retrieval.max_batch == 2
        with httpx.Client(base_url=capped.url, timeout=120) as capped_client:
            answers, batches = ask_together(capped, capped_client)
    assert batches >= -(-len(QUESTIONS) // 2)
    assert_answered_as_alone(answers, alone)
    with pytest.raises(ValueError, match="retrieval_batch must be positive"):
        ServerConfig(index_dir=index, retrieval_batch=0)


def chat_body(model: str, question: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": "Something earlier."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": question},
    ], **extra}


def test_chat_over_the_index_answers_as_ask_with_sources_streamed_and_not(client: httpx.Client) -> None:
    served = client.get("/v1/models").json()["data"][0]["id"]
    model = served + "+index"
    question = QUESTIONS[2]
    asked = client.post("/v1/ask", json={"question": question, "max_new_tokens": 6}).json()

    response = client.post("/v1/chat/completions", json=chat_body(model, question))
    assert response.status_code == 200, response.text
    chat = response.json()
    assert chat["object"] == "chat.completion" and chat["model"] == model
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": asked["answer"]}
    assert chat["choices"][0]["finish_reason"] == asked["finish_reason"]
    assert [s["chunk_id"] for s in chat["sources"]] == [s["chunk_id"] for s in asked["sources"]]
    assert chat["sources"][0]["doc_id"] == asked["sources"][0]["doc_id"] and chat["sources"][0]["text"]
    assert [s["rank"] for s in chat["sources"]] == list(range(1, len(chat["sources"]) + 1))
    # the same cache reuse as /v1/ask: the retrieved chunks' entries are read, not recomputed
    assert chat["usage"]["prompt_tokens"] == asked["usage"]["prompt_tokens"]
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == asked["usage"]["cached_tokens"] > 0
    assert chat["usage"]["segments"] == len(chat["sources"]) + 1 and chat["usage"]["cache_hits"] > 0

    body = chat_body(model, question, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == model for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_sources = [chunk for chunk in chunks if "sources" in chunk]
    assert len(with_sources) == 1 and with_sources[0]["choices"] == []
    assert [s["chunk_id"] for s in with_sources[0]["sources"]] == [s["chunk_id"] for s in asked["sources"]]
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    assert text == asked["answer"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        asked["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == asked["usage"][
        "completion_tokens"]


def test_chat_over_the_index_refuses_what_it_cannot_do(client: httpx.Client) -> None:
    model = client.get("/v1/models").json()["data"][1]["id"]
    assert model.endswith("+index")
    cases = [
        (chat_body(model, QUESTIONS[0], n=2), "n"),
        (chat_body(model, QUESTIONS[0], logprobs=True), "logprobs"),
        ({"model": model, "messages": [{"role": "system", "content": "Hello."}]}, "messages"),
        ({"model": model, "messages": [{"role": "user", "content": "   "}]}, "question"),
    ]
    for body, field in cases:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (field, response.text)
        assert field in response.text
    unknown = client.post("/v1/chat/completions", json=chat_body(model + "x", QUESTIONS[0]))
    assert unknown.status_code == 404 and "+index" in unknown.text
    # a completion has no index variant
    assert client.post("/v1/completions", json={"model": model, "prompt": "Hi?"}).status_code == 404


def test_the_documented_chat_over_the_index_runs_with_the_openai_client(server: ServerThread, capsys) -> None:
    """docs/service.md's snippet, as written but for the server's address."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "service.md").read_text(encoding="utf-8")
    section = text[text.index("**Chat over the served index.**"):]
    start = section.index("```python\n") + len("```python\n")
    snippet = section[start:section.index("\n```", start)]
    assert 'base_url="http://127.0.0.1:8000/v1"' in snippet
    exec(snippet.replace("http://127.0.0.1:8000", server.url), {})  # noqa: S102 - the documentation's own code
    printed = capsys.readouterr().out
    assert "glassblowing.md" in printed  # the question's document is among the sources


def wait_for(condition: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_a_step_held_for_coming_prefills_runs_them_in_one_pass_answered_as_alone(
    tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, client: httpx.Client
) -> None:
    """While prefills are coming (here: an event the test holds set), a step whose prefills wait is held: three
    questions retrieved one batch at a time reach the scheduler and no step runs; once none are coming, ONE pass
    prefills all three, and each answer is the one it gets alone."""
    asked = QUESTIONS[:3]
    alone = {question: ask(client, question) for question in asked}
    index = copy_tiny_index(tmp_path_factory.mktemp("prefill_hold") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", max_running=8, retrieval_batch=1)) as held:
        service = held.app.state.service
        worker, scheduler = service.worker, service.worker.scheduler
        # the model's one scheduler, the pipeline's too, with the server's flags
        assert scheduler is worker.backend.pipeline.session.scheduler and scheduler.config.max_running == 8
        coming = threading.Event()
        coming.set()
        worker.hold_steps_for(coming.is_set, 120.0)
        reports: list[Any] = []
        observe = scheduler.on_step
        scheduler.on_step = lambda report: (reports.append(report), observe(report))
        answers: dict[str, dict[str, Any]] = {}

        def ask_alone_client(question: str) -> None:
            with httpx.Client(base_url=held.url, timeout=120) as http:
                answers[question] = ask(http, question)

        threads = [threading.Thread(target=ask_alone_client, args=(question,)) for question in asked]
        for number, thread in enumerate(threads):
            thread.start()
            wait_for(lambda number=number: scheduler.waiting == number + 1, f"question {number + 1} in the scheduler")
        time.sleep(0.3)
        assert reports == [] and scheduler.steps == 0, "a step ran while prefills were coming"
        coming.clear()
        worker.wake()
        for thread in threads:
            thread.join(120)
    prefill_steps = [report for report in reports if report.prefills]
    assert prefill_steps[0].prefills == len(asked) and len(prefill_steps) == 1
    assert_answered_as_alone(answers, alone, asked)


def test_a_held_step_runs_after_the_prefill_wait_and_the_stage_says_when_a_batch_is_coming(
    tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, client: httpx.Client
) -> None:
    """The hold is bounded: prefills said to be coming forever are still answered after `prefill_wait_s`. The
    stage's `retrieving_batch` is true while a batch is retrieved (here held on the index lock) and false once its
    questions reached the scheduler. A bad `prefill_wait_s` is refused."""
    question = QUESTIONS[1]
    alone = ask(client, question)
    index = copy_tiny_index(tmp_path_factory.mktemp("prefill_wait") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", prefill_wait_s=0.2)) as held:
        service = held.app.state.service
        stage = service.retrieval
        answers: dict[str, dict[str, Any]] = {}

        def ask_once() -> None:
            with httpx.Client(base_url=held.url, timeout=120) as http:
                answers[question] = ask(http, question)

        with service.backend.index_lock:
            thread = threading.Thread(target=ask_once)
            thread.start()
            wait_for(lambda: stage.retrieving_batch, "the stage retrieving the question")
        thread.join(120)
        assert not stage.retrieving_batch
        assert_answered_as_alone(answers, {question: alone}, [question])

        service.worker.hold_steps_for(lambda: True, 0.2)  # coming forever: each step waits 0.2 s, then runs
        answers.clear()
        ask_once()
        assert_answered_as_alone(answers, {question: alone}, [question])
    for bad in (-0.1, 11, True, "0.05"):
        with pytest.raises(ValueError, match="prefill_wait_s must be a number of seconds"):
            ServerConfig(index_dir=index, prefill_wait_s=bad)



def test_no_step_is_held_while_every_slot_is_taken(
    tmp_path_factory: pytest.TempPathFactory, copy_tiny_index, client: httpx.Client
) -> None:
    """`max_running` 1 and prefills said to be coming: the one running sequence decodes to its end while another
    waits for its slot (holding would stall it: the waiting prefill cannot be admitted by that step anyway); the
    waiting one is answered once none are coming. Both as alone."""
    alone = {question: ask(client, question) for question in QUESTIONS}
    first = next(question for question in QUESTIONS if alone[question]["usage"]["completion_tokens"] >= 2)
    second = next(question for question in QUESTIONS if question != first)
    index = copy_tiny_index(tmp_path_factory.mktemp("prefill_full") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", max_running=1)) as held:
        service = held.app.state.service
        worker, scheduler = service.worker, service.worker.scheduler
        coming = threading.Event()
        worker.hold_steps_for(coming.is_set, 120.0)
        answers: dict[str, dict[str, Any]] = {}

        def ask_once(question: str) -> None:
            with httpx.Client(base_url=held.url, timeout=120) as http:
                answers[question] = ask(http, question)

        threads = {question: threading.Thread(target=ask_once, args=(question,)) for question in (first, second)}
        with scheduler.lock:  # no step until both wait: the first is then admitted, the second waits for its slot
            threads[first].start()
            wait_for(lambda: scheduler.waiting == 1, "the first question in the scheduler")
            threads[second].start()
            wait_for(lambda: scheduler.waiting == 2, "the second question in the scheduler")
            coming.set()
        threads[first].join(60)
        assert first in answers, "the running sequence was held while every slot was taken"
        coming.clear()
        worker.wake()
        threads[second].join(120)
    assert_answered_as_alone(answers, alone, [first, second])
