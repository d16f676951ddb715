"""Every field a client sends is checked before use, against a real uvicorn server on 127.0.0.1 (tiny model):

- every numeric field of every request body states its range, and out-of-range, huge, negative, non-numeric,
  non-finite and non-UTF-8 values are each a 4xx naming the field (and the range), never a 5xx;
- types are strict: `"match_segments": "no"` is a 400 naming the field (it was taken as true), as is `"3"` for an
  integer, on every route;
- a recompute policy spec out of range in `/v1/ask` is a 400 naming `recompute_policy` and the range (a 20-digit
  seam was a 500 `internal_error`);
- binary data sent to `/v1/documents` as text is a 400 naming the field and the limit (300 KB of it became 2,195
  chunks over 159 s and 2.7 GiB);
- the server's log holds one line per refusal and one record (with its traceback) per unexpected error, each
  naming the request's id (the probes above left three tracebacks in it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import types
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from hypic_rag.server import ServerConfig
from hypic_rag.server.chat_schemas import ChatCompletionRequest
from hypic_rag.server.errors import stated_range
from hypic_rag.server.openai_schemas import CompletionRequest
from hypic_rag.server.runner import ServerThread
from hypic_rag.server.schemas import AddDocumentsRequest, AskRequest

BODIES: dict[str, tuple[type[BaseModel], dict[str, Any]]] = {
    "/v1/ask": (AskRequest, {"question": "Where does the river flow?", "max_new_tokens": 1}),
    "/v1/completions": (CompletionRequest, {"prompt": "Where does the river flow?", "max_tokens": 1}),
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    "/v1/documents": (AddDocumentsRequest, {"documents": [{"id": "a", "text": "Some text."}]}),
}


UNHANDLED = "/v1/test-only/unhandled"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Iterator[ServerThread]:
    index = copy_tiny_index(tmp_path_factory.mktemp("server_input_checks") / "index")
    running = ServerThread(ServerConfig(index_dir=index, device="cpu", max_new_tokens=64))

    async def unhandled() -> None:  # a bug no handler knows: what does the log keep of it?
        raise RuntimeError("unexpected")

    running.app.add_api_route(UNHANDLED, unhandled, methods=["POST"])
    with running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def is_number(annotation: Any) -> bool:
    arguments = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(argument in (int, float) for argument in arguments)


def numeric_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, FieldInfo) of every int / float field of `model` and of the models it nests."""
    for name, field in model.model_fields.items():
        if is_number(field.annotation):
            yield prefix + name, field
        for argument in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(argument, type) and issubclass(argument, BaseModel):
                yield from numeric_fields(argument, f"{prefix}{name}.")


NUMERIC = [(path, name, field) for path, (model, _) in BODIES.items() for name, field in numeric_fields(model)]


def post(client: httpx.Client, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body)
    return client.post(path, content=content, headers={"content-type": "application/json"})


def test_every_numeric_field_of_every_body_states_its_range() -> None:
    assert {(path, name) for path, name, _ in NUMERIC} >= {
        ("/v1/ask", "top_k"), ("/v1/ask", "seed"), ("/v1/ask", "timeout_s"), ("/v1/completions", "max_tokens"),
        ("/v1/completions", "best_of"), ("/v1/chat/completions", "max_completion_tokens")}
    unbounded = [f"{path} {name}" for path, name, field in NUMERIC if stated_range(field) is None]
    assert unbounded == []


@pytest.mark.parametrize(("path", "name", "field"), NUMERIC, ids=[f"{p}:{n}" for p, n, _ in NUMERIC])
def test_every_numeric_field_refuses_what_lies_outside_its_range(client: httpx.Client, path: str, name: str,
                                                                 field: Any) -> None:
    allowed = stated_range(field)
    below = allowed.minimum if allowed.minimum_exclusive else allowed.minimum - 1
    values: list[Any] = [below, allowed.maximum + 1, 10**30, -(10**30), "abc", "7", True, [1], float("nan")]
    if allowed.integer:
        values.append(1.5)
    base = BODIES[path][1]
    for value in values:
        response = post(client, path, {**base, name: value})
        assert response.status_code in (400, 422), (value, response.text)
        error = response.json()["error"]
        assert error["param"] == name and error["message"].startswith(f"{name}: "), (value, error)
        if not isinstance(value, list):
            assert allowed.describe() in error["message"], (value, error["message"])
        if isinstance(value, (str, bool)) or (allowed.integer and value == 1.5):
            assert response.status_code == 400, (value, response.text)  # the wrong JSON type
    raw = json.dumps({**base, name: "@"}).encode().replace(b'"@"', b'"\xff\xfe"')  # not UTF-8
    response = post(client, path, raw)
    assert response.status_code == 400 and response.json()["error"]["param"] == "body", response.text
    assert "UTF-8" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("value", ["string", "no", "false", 0, 1, "true"])
def test_a_boolean_must_be_a_boolean(client: httpx.Client, path: str, value: Any) -> None:
    """`"match_segments": "string"` was taken as true and `"no"` as false (200)."""
    for name in ("match_segments", "stream", "echo" if path == "/v1/completions" else "logprobs"):
        response = post(client, path, {**BODIES[path][1], name: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and "valid boolean" in error["message"], error


@pytest.mark.parametrize(("body", "name"), [
    ({"stream": "yes"}, "stream"), ({"top_k": "3"}, "top_k"), ({"question": 42}, "question"),
    ({"mode": ["hypic"]}, "mode"), ({"recompute_policy": 8}, "recompute_policy"),
])
def test_ask_refuses_every_wrong_type_with_400(client: httpx.Client, body: dict[str, Any], name: str) -> None:
    response = post(client, "/v1/ask", {**BODIES["/v1/ask"][1], **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text


def test_token_ids_and_logit_bias_are_checked_against_the_vocabulary(client: httpx.Client) -> None:
    base = BODIES["/v1/completions"][1]
    for body, name in (({"prompt": [10**30]}, "prompt"), ({"prompt": [-1]}, "prompt"), ({"prompt": [1.5]}, "prompt"),
                       ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"), ({"logit_bias": {"1": 1e9}}, "logit_bias"),
                       ({"logit_bias": {"99999999999": 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias")):
        response = post(client, "/v1/completions", {**base, **body})
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"].startswith(name), (body, response.text)


@pytest.mark.parametrize(("spec", "message"), [
    ("seam@9999999999999999999", "0..65536"), ("seam@" + "9" * 5000, "0..65536"), ("whole:4097", "1..4096"),
    ("budget:10001", "1..10000"), ("tokens:99999999999", "1..16777216"), ("seam@-1", "expected one of"),
])
def test_an_out_of_range_policy_spec_is_400_naming_the_field(client: httpx.Client, spec: str, message: str) -> None:
    """It was a 500 `internal_error` (a ValueError from deep inside the encoder)."""
    response = post(client, "/v1/ask", {**BODIES["/v1/ask"][1], "recompute_policy": spec})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "recompute_policy" and message in error["message"] and len(error["message"]) < 400


@pytest.mark.parametrize("errors", ["latin-1", "replace", "ignore"])
def test_binary_data_sent_as_document_text_is_refused(client: httpx.Client, errors: str) -> None:
    garbage = os.urandom(300_000)
    text = garbage.decode("latin-1") if errors == "latin-1" else garbage.decode("utf-8", errors=errors)
    documents = [{"id": "fine", "text": "A real document about the harbour."}, {"id": "garbage", "text": text}]
    response = post(client, "/v1/documents", {"documents": documents})
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["param"] == "documents[1].text" and "binary data, not text" in error["message"]
    assert "text has at most 1%" in error["message"]
    assert client.get("/healthz").json()["pending_jobs"] == 0  # no job was started for any of them


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def server_log() -> Iterator[list[logging.LogRecord]]:
    """Every record the service (hypic_rag) and uvicorn log at INFO and above while the test runs."""
    handler = Records()
    loggers = [logging.getLogger("hypic_rag"), logging.getLogger("uvicorn")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)


def test_the_log_holds_one_line_per_refusal_and_one_record_per_bug(
    server: ServerThread, client: httpx.Client, server_log: list[logging.LogRecord]
) -> None:
    ask = BODIES["/v1/ask"][1]
    probes = {
        "policy": ("/v1/ask", {**ask, "recompute_policy": "seam@9999999999999999999"}, 400),
        "type": ("/v1/ask", {**ask, "top_k": "many"}, 400),
        "range": ("/v1/ask", {**ask, "seed": -1}, 422),
        "long": ("/v1/ask", {**ask, "question": "x" * 5_000}, 413),
        "mode": ("/v1/ask", {**ask, "mode": "bogus", "stream": True}, 400),
        "boolean": ("/v1/completions", {**BODIES["/v1/completions"][1], "match_segments": "string"}, 400),
        "utf8": ("/v1/ask", b'{"question": "\xff"}', 400),
        "route": ("/v1/nothing-here", {}, 404),
    }
    for name, (path, body, status) in probes.items():
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = client.post(path, content=content, headers={"content-type": "application/json",
                                                                "x-request-id": f"probe-{name}"})
        assert response.status_code == status, (name, response.text)
        assert response.headers["x-request-id"] == f"probe-{name}"
    missing = client.delete("/v1/documents/no-such-document", headers={"x-request-id": "probe-delete"})
    assert missing.status_code == 404
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:  # not HTTP at all
        raw.sendall(b"\x16\x03\x01 garbage that is no request\r\n\r\n")
        raw.recv(4096)
    bug = client.post(UNHANDLED, headers={"x-request-id": "probe-bug"})
    assert bug.status_code == 500 and "(request probe-bug)" in bug.json()["error"]["message"]
    fresh = client.post("/v1/ask", json={**ask, "top_k": 0})
    assert len(fresh.headers["x-request-id"]) == 16  # one was made up for a request without its own
    time.sleep(0.5)  # uvicorn logs the garbage connection on its own schedule

    for name in [*probes, "delete"]:
        about = [record for record in server_log if f"request probe-{name}:" in record.getMessage()]
        assert len(about) == 1, (name, [record.getMessage() for record in about])
        assert about[0].exc_info is None and "\n" not in about[0].getMessage(), name
        assert about[0].levelno == logging.INFO, name
    with_traceback = [record for record in server_log if record.exc_info]
    assert len(with_traceback) == 1, [record.getMessage() for record in with_traceback]
    assert "request probe-bug:" in with_traceback[0].getMessage() and with_traceback[0].levelno == logging.ERROR
    garbage = [record for record in server_log if "Invalid HTTP request" in record.getMessage()]
    assert len(garbage) == 1 and garbage[0].exc_info is None


@pytest.mark.parametrize("path", ["/v1/ask", "/v1/completions", "/v1/chat/completions"])
def test_a_body_nested_too_deeply_is_invalid_json(client: httpx.Client, path: str) -> None:
    """JSON nested 100,000 deep cannot be parsed (RecursionError): 400 `invalid_json`, as the `--workers` front
    answers it (it was a 400 with the undocumented code `http_error`; the front gave a 500)."""
    response = post(client, path, ("[" * 100_000 + "]" * 100_000).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and error["param"] == "body", error
