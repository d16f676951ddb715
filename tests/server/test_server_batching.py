"""The service's continuous batching against a real uvicorn server on 127.0.0.1 (tiny model): 32 concurrent requests
(asks and completions, streamed and not, greedy and seeded sampling, several choices) get exactly what the same
requests get one by one, in batched steps; requests beyond the waiting queue get 429 with a message; a stream whose
client goes away frees its place in the batch at once; /metrics shows the scheduler."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS


def metric(client: httpx.Client, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and (labels is None or all(sample.labels.get(k) == v for k, v in labels.items())):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels or ''}")


def mixed_calls() -> list[tuple[str, dict[str, Any]]]:
    """32 requests: asks (streamed or not), completions (greedy, seeded sampling with two choices, streamed)."""
    calls: list[tuple[str, dict[str, Any]]] = []
    questions = list(SMALL_CORPUS_QUESTIONS.values())
    for number in range(32):
        question = questions[number % len(questions)]
        kind = number % 4
        if kind == 0:
            calls.append(("/v1/ask", {"question": question, "top_k": 2, "max_new_tokens": 8}))
        elif kind == 1:
            calls.append(("/v1/ask", {"question": question, "top_k": 3, "max_new_tokens": 6, "stream": True}))
        elif kind == 2:
            prompt = DEFAULT_SEPARATOR.join([f"Note {number % 5}: the keeper is Ingrid Holm.", question])
            calls.append(("/v1/completions", {"prompt": prompt, "max_tokens": 7, "temperature": 0.8,
                                              "seed": number, "n": 2}))
        else:
            prompt = DEFAULT_SEPARATOR.join(["Kestrel Bay has a lighthouse.", f"Who keeps it? ({number % 3})"])
            calls.append(("/v1/completions", {"prompt": prompt, "max_tokens": 9, "temperature": 0,
                                              "stream": number % 8 == 3}))
    return calls


def outcome(path: str, body: dict[str, Any], response: httpx.Response) -> Any:
    """What must match between the batched and the one-by-one answer."""
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        payload = response.json()
        if path == "/v1/ask":
            return payload["answer"], payload["finish_reason"], [s["chunk_id"] for s in payload["sources"]]
        return [(choice["text"], choice["finish_reason"]) for choice in payload["choices"]]
    events = [json.loads(line[len("data: "):]) for line in response.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    if path == "/v1/ask":
        done = events[-1]
        assert done["type"] == "done", events[-1]
        return "".join(e["text"] for e in events if e["type"] == "token"), done["answer"], done["finish_reason"]
    return "".join(choice["text"] for event in events for choice in event["choices"])


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("server_batching") / "index")


def test_32_concurrent_requests_equal_the_same_requests_one_by_one(index: Path) -> None:
    calls = mixed_calls()
    with ServerThread(ServerConfig(index_dir=index, device="cpu", max_running=12)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            alone = [outcome(path, body, client.post(path, json=body)) for path, body in calls]
            steps_before = metric(client, "hypic_batch_size_count")

            async def burst() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
                    return list(await asyncio.gather(*(http.post(path, json=body) for path, body in calls)))

            responses = asyncio.run(burst())
            together = [outcome(path, body, response) for (path, body), response in zip(calls, responses)]
            for number, (mine, theirs) in enumerate(zip(together, alone)):
                assert mine == theirs, f"request {number} ({calls[number][0]}) differs when batched"
            # the burst ran in batched steps: some step held more than one sequence, none more than max_running
            steps = metric(client, "hypic_batch_size_count") - steps_before
            single = metric(client, "hypic_batch_size_bucket", {"le": "1.0"})
            assert steps > 0 and metric(client, "hypic_batch_size_count") > single
            assert metric(client, "hypic_batch_size_bucket", {"le": "16.0"}) == metric(client, "hypic_batch_size_count")
            assert metric(client, "hypic_step_tokens_count") == metric(client, "hypic_batch_size_count")
            assert metric(client, "hypic_running_sequences") == 0 and metric(client, "hypic_waiting_requests") == 0
            assert client.get("/healthz").json()["queue_depth"] == 0


def long_completion(eos_token_id: int) -> dict[str, Any]:
    """A completion that runs for its whole length (the end-of-sequence token is banned)."""
    return {"prompt": f"Orla keeps goats.{DEFAULT_SEPARATOR}Who keeps goats?", "max_tokens": 1000,
            "temperature": 0, "logit_bias": {str(eos_token_id): -100}, "stream": True}


def test_a_full_waiting_queue_is_429_and_a_stream_that_goes_away_frees_its_place(index: Path, tiny_model: Path) -> None:
    eos = int(json.loads((tiny_model / "config.json").read_text())["eos_token_id"])
    config = ServerConfig(index_dir=index, device="cpu", max_running=1, queue_size=2)
    with ServerThread(config) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=long_completion(eos), timeout=120) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith('data: {"id"')
            assert metric(client, "hypic_running_sequences") == 1
            waiting: list[httpx.Response] = []
            short = {"question": SMALL_CORPUS_QUESTIONS["chess.md"], "top_k": 1, "max_new_tokens": 3}
            threads = [threading.Thread(target=lambda: waiting.append(httpx.post(f"{server.url}/v1/ask", json=short,
                                                                                 timeout=120)))
                       for _ in range(2)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while metric(client, "hypic_waiting_requests") < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert metric(client, "hypic_waiting_requests") == 2  # both wait behind the one running
            refused = client.post("/v1/ask", json=short)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and "queue is full" in error["message"]
            assert int(refused.headers["retry-after"]) >= 1
            assert waiting == [], "a waiting request was answered while the long one held the only place"
        began = time.monotonic()  # the long stream's client went away: its place goes to the waiting requests
        for thread in threads:
            thread.join(60)
        assert time.monotonic() - began < 10
        assert [response.status_code for response in waiting] == [200, 200]
        assert metric(client, "hypic_running_sequences") == 0 and metric(client, "hypic_waiting_requests") == 0
        assert metric(client, "hypic_queue_rejections_total") >= 1
