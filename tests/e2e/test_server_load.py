"""A bounded load test against a real uvicorn server on 127.0.0.1 (tiny model): 100 requests from 16 concurrent
clients, each on its own kept-alive connection, mixing valid asks and completions (plain and streamed, greedy)
with bad inputs (out-of-range seeds, lone surrogates, oversize bodies and questions, malformed JSON, unknown mode,
empty question, bad fields) and a tiny temperature.

Must hold: zero 5xx, zero connection resets (every client keeps its one connection to the end), every bad input
its 4xx, every valid answer equal to the same request sent alone (streamed deltas included), the server alive
and idle at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
from hypic_rag.server.errors import ERROR_CODES
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS

CLIENTS = 16
REQUESTS = 100
MAX_BODY_BYTES = 16_384
JSON_HEADERS = {"content-type": "application/json"}


@dataclass(frozen=True)
class Call:
    """One request of the mix: `expect` is 200 for a valid one (its answer is checked) or the 4xx it must get."""

    name: str
    path: str
    body: Any  # a dict sent as JSON, raw bytes, or "chunked-oversize"
    expect: int = 200
    stream: bool = False
    reference: str = ""  # the valid request whose answer (sent alone) this one must equal; "" is its own name


def valid_calls() -> list[Call]:
    calls = []
    for document, question in SMALL_CORPUS_QUESTIONS.items():
        body = {"question": question, "top_k": 2, "max_new_tokens": 6}
        calls.append(Call(f"ask:{document}", "/v1/ask", body))
        calls.append(Call(f"ask:{document}:stream", "/v1/ask", {**body, "stream": True}, stream=True,
                          reference=f"ask:{document}"))
    prompts = {
        "lighthouse": ["Kestrel Bay has a lighthouse.", "The keeper is Ingrid Holm.", "Who keeps it?"],
        "goats": ["Orla keeps goats.", "The goats are Fen and Moss.", "Who keeps goats?"],
        "order": ["The keeper is Ingrid Holm.", "Kestrel Bay has a lighthouse.", "Who keeps it?"],
        "single": ["What is the capital of Tessaly?"],
    }
    for name, segments in prompts.items():
        body = {"prompt": DEFAULT_SEPARATOR.join(segments), "max_tokens": 6, "temperature": 0}
        calls.append(Call(f"cmpl:{name}", "/v1/completions", body))
        calls.append(Call(f"cmpl:{name}:stream", "/v1/completions", {**body, "stream": True}, stream=True,
                          reference=f"cmpl:{name}"))
        calls.append(Call(f"cmpl:{name}:tiny-temperature", "/v1/completions", {**body, "temperature": 1e-45},
                          reference=f"cmpl:{name}"))
    return calls


def bad_calls() -> list[Call]:
    ask = {"question": SMALL_CORPUS_QUESTIONS["chess.md"], "top_k": 2, "max_new_tokens": 6}
    completion = {"prompt": f"Orla keeps goats.{DEFAULT_SEPARATOR}Who?", "max_tokens": 6}
    return [
        Call("ask:seed-2**64", "/v1/ask", {**ask, "seed": 2**64, "temperature": 1.0}, 422),
        Call("ask:seed-negative:stream", "/v1/ask", {**ask, "seed": -(2**70), "stream": True}, 422),
        Call("ask:surrogate", "/v1/ask", {**ask, "question": "Who \ud800 is it?"}, 422),
        Call("ask:surrogate:stream", "/v1/ask", {**ask, "question": "\udfff", "stream": True}, 422),
        Call("ask:empty", "/v1/ask", {**ask, "question": " \n "}, 400),
        Call("ask:mode", "/v1/ask", {**ask, "mode": "turbo"}, 400),
        Call("ask:top_k", "/v1/ask", {**ask, "top_k": 0}, 422),
        Call("ask:long-question", "/v1/ask", {**ask, "question": "why " * 200}, 413),
        Call("ask:oversize-body", "/v1/ask", b'{"question": "' + b"x" * (MAX_BODY_BYTES + 100) + b'"}', 413),
        Call("ask:oversize-chunked", "/v1/ask", "chunked-oversize", 413),
        Call("ask:malformed", "/v1/ask", b'{"question": "Who?", ', 422),
        Call("cmpl:seed-2**64", "/v1/completions", {**completion, "seed": 2**64}, 400),
        Call("cmpl:seed-negative:stream", "/v1/completions", {**completion, "seed": -(2**70), "stream": True}, 400),
        Call("cmpl:surrogate", "/v1/completions", {**completion, "prompt": "Doc \ud800.<<PIC_SEP>>Who?"}, 400),
        Call("cmpl:temperature-nan", "/v1/completions", {**completion, "temperature": float("nan")}, 400),
        Call("cmpl:empty-query", "/v1/completions", {**completion, "prompt": "Doc.<<PIC_SEP>>  "}, 400),
    ]


async def _chunked_oversize() -> AsyncIterator[bytes]:
    yield b'{"question": "'
    for _ in range(MAX_BODY_BYTES // 1000 + 4):
        yield b"y" * 1000
    yield b'"}'


@dataclass
class Outcome:
    call: Call
    status: int | None = None
    answer: str | None = None
    error: str | None = None
    connection: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


async def send(http: httpx.AsyncClient, call: Call) -> Outcome:
    """Send `call`; a valid one's answer (streamed: the concatenated deltas, checked against the final answer)."""
    outcome = Outcome(call)
    if call.body == "chunked-oversize":
        content, headers = _chunked_oversize(), JSON_HEADERS
    elif isinstance(call.body, bytes):
        content, headers = call.body, JSON_HEADERS
    else:
        content, headers = json.dumps(call.body).encode(), JSON_HEADERS  # escapes lone surrogates as \ud800
    try:
        async with http.stream("POST", call.path, content=content, headers=headers) as response:
            outcome.status = response.status_code
            outcome.connection = response.extensions["network_stream"].get_extra_info("client_addr")
            body = (await response.aread()).decode()
    except (httpx.HTTPError, OSError) as error:  # a reset or a connection the server dropped
        outcome.error = f"{type(error).__name__}: {error}"
        return outcome
    if outcome.status != 200:
        try:
            outcome.extra = json.loads(body)
        except json.JSONDecodeError:
            outcome.extra = {"body": body[:200]}
        return outcome
    if not call.stream:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            outcome.error = f"status 200 with a body that is not JSON: {body[:200]!r}"
            return outcome
        outcome.answer = data["answer"] if call.path == "/v1/ask" else data["choices"][0]["text"]
        return outcome
    frames = body.strip().split("\n\n")
    assert frames[-1] == "data: [DONE]", (call.name, frames[-1])
    events = [json.loads(frame[len("data: "):]) for frame in frames[:-1]]
    if call.path == "/v1/ask":
        assert events[-1]["type"] == "done", (call.name, events[-1])
        outcome.answer = "".join(e["text"] for e in events if e["type"] == "token")
        outcome.extra = {"final": events[-1]["answer"]}
    else:
        assert "error" not in events[-1], (call.name, events[-1])
        outcome.answer = "".join(c["choices"][0]["text"] for c in events if c["choices"])
        outcome.extra = {"final": outcome.answer}
    return outcome


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index):
    index = copy_tiny_index(tmp_path_factory.mktemp("server_load") / "index")
    config = ServerConfig(index_dir=index, device="cpu", max_body_bytes=MAX_BODY_BYTES, max_question_chars=500,
                          max_new_tokens=32, request_timeout_s=120.0)
    with ServerThread(config) as running:
        yield running


def test_hundred_requests_from_sixteen_clients(server: ServerThread) -> None:
    valid, bad = valid_calls(), bad_calls()
    rng = random.Random(12)
    mix = [*valid, *bad, *bad]  # every case at least once (bad ones twice), then random valid ones
    mix += [rng.choice(valid) for _ in range(REQUESTS - len(mix))]
    rng.shuffle(mix)
    assert len(mix) == REQUESTS

    async def alone() -> dict[str, str]:
        """Each distinct valid request sent alone, nothing else in flight."""
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            answers = {}
            for call in valid:
                if not call.reference:
                    outcome = await send(http, call)
                    assert outcome.status == 200, (call.name, outcome)
                    answers[call.name] = outcome.answer
            return answers

    async def client(calls: list[Call]) -> list[Outcome]:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)  # one kept-alive connection each
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return [await send(http, call) for call in calls]

    async def load() -> list[list[Outcome]]:
        return list(await asyncio.gather(*(client(mix[number::CLIENTS]) for number in range(CLIENTS))))

    reference = asyncio.run(alone())
    began = time.perf_counter()
    per_client = asyncio.run(load())
    seconds = time.perf_counter() - began
    outcomes = [outcome for outcomes in per_client for outcome in outcomes]
    assert len(outcomes) == REQUESTS

    failures = [f"{o.call.name}: {o.error}" for o in outcomes if o.error is not None]
    assert not failures, f"connection errors: {failures}"
    server_errors = [(o.call.name, o.status, o.extra) for o in outcomes if o.status >= 500]
    assert not server_errors, f"5xx answers: {server_errors}"
    for outcome in outcomes:
        call = outcome.call
        assert outcome.status == call.expect, (call.name, outcome.status, outcome.extra)
        if call.expect == 200:
            expected = reference[call.reference or call.name]
            assert outcome.answer == expected, (call.name, outcome.answer, expected)
            if call.stream:
                assert outcome.extra["final"] == outcome.answer, (call.name, outcome.extra)
        else:
            error = outcome.extra["error"]
            assert error["code"] in ERROR_CODES and error["message"], (call.name, error)
    for of_client in per_client:  # a dropped connection would show as a second one
        assert len({o.connection for o in of_client}) == 1, [(o.call.name, o.connection) for o in of_client]

    health = httpx.get(f"{server.url}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["queue_depth"] == 0
    print(f"\n{REQUESTS} requests from {CLIENTS} clients in {seconds:.1f} s: "
          f"{sum(o.status == 200 for o in outcomes)} answered, {sum(o.status != 200 for o in outcomes)} refused (4xx)")
