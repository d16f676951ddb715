"""Inputs that passed validation but broke the service, against a real uvicorn server on 127.0.0.1 (tiny model):

- `seed` outside [0, 2**64 - 1] and text holding a lone surrogate are 422 naming the field (they were 500s);
- a tiny temperature answers as greedy (it was a 500: inf/nan probabilities);
- after any error response the kept-alive connection serves the next request (a 500 used to drop it);
- unseeded sampling differs between requests, a seed reproduces;
- streamed deltas add up exactly to the final answer (/v1/ask, /v1/completions);
- `cached_tokens` counts only tokens reused from before the request; `encoded_tokens` the ones encoded during it.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
from hypic_rag.server.errors import ERROR_CODES
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS

SEAM = 8
UNHANDLED = "/v1/test-only/unhandled"
LIMITS = dict(max_body_bytes=16_384, max_question_chars=500, max_new_tokens=64, request_timeout_s=60.0)
ASK = {"question": SMALL_CORPUS_QUESTIONS["chess.md"], "top_k": 2, "max_new_tokens": 6}
COMPLETION = {"prompt": DEFAULT_SEPARATOR.join(["Kestrel Bay has a lighthouse.", "Who keeps it?"]), "max_tokens": 6,
              "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index):
    index = copy_tiny_index(tmp_path_factory.mktemp("server_robustness") / "index")
    assert json.loads((index / "manifest.json").read_text())["seam_tokens"] == SEAM
    running = ServerThread(ServerConfig(index_dir=index, device="cpu", **LIMITS))

    async def unhandled() -> None:  # a bug no handler knows, to check what a 500 leaves behind
        raise RuntimeError("unexpected")

    running.app.add_api_route(UNHANDLED, unhandled, methods=["POST"])
    with running:
        yield running


@pytest.fixture()
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def post(client: httpx.Client, path: str, body: dict) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped (httpx's own `json=` cannot encode a lone surrogate)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def connection_of(response: httpx.Response) -> tuple:
    """The client side (address, port) of the TCP connection that carried `response`."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


def sse_payloads(response: httpx.Response) -> list[dict]:
    frames = response.read().decode().strip().split("\n\n")
    assert frames[-1] == "data: [DONE]", frames[-1]
    return [json.loads(frame[len("data: "):]) for frame in frames[:-1]]


def ask_stream(client: httpx.Client, body: dict) -> tuple[list[str], dict]:
    with client.stream("POST", "/v1/ask", content=json.dumps({**body, "stream": True}),
                       headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200
        events = sse_payloads(response)
    assert events[-1]["type"] == "done", events[-1]
    return [e["text"] for e in events if e["type"] == "token"], events[-1]


def completion_stream(client: httpx.Client, body: dict) -> tuple[list[str], dict]:
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", content=json.dumps(body),
                       headers={"content-type": "application/json"}) as response:
        assert response.status_code == 200
        chunks = sse_payloads(response)
    assert "error" not in chunks[-1], chunks[-1]
    deltas = [c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    return deltas, chunks[-1]


# ----------------------------------------------------------------------------------------------------------------- 422s
BAD_INPUTS = [
    ("/v1/ask", {**ASK, "seed": 2**64}, "seed", "must be an integer in 0..18446744073709551615, got 18446744073709551616"),
    ("/v1/ask", {**ASK, "seed": -(2**70)}, "seed", "must be an integer in 0..18446744073709551615, got -1180591620717411303424"),
    ("/v1/ask", {**ASK, "question": "Who \ud800 founded the studio?"}, "question", "lone surrogate"),
    ("/v1/ask", {**ASK, "temperature": 1e400}, "temperature", "must be a number in 0..5, got inf"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed", "must be an integer in 0..18446744073709551615, got 18446744073709551616"),
    ("/v1/completions", {**COMPLETION, "seed": -(2**70)}, "seed", "must be an integer in 0..18446744073709551615, got -1180591620717411303424"),
    ("/v1/completions", {**COMPLETION, "prompt": "Who \ud800?"}, "prompt", "lone surrogate"),
    ("/v1/completions", {**COMPLETION, "prompt": f"A doc \udfff.{DEFAULT_SEPARATOR}Who?"}, "prompt", "lone surrogate"),
    ("/v1/completions", {**COMPLETION, "prompt": ["Who \ud800?"]}, "prompt", "lone surrogate"),
    ("/v1/completions", {**COMPLETION, "stop": ["x", "\ud800"]}, "stop", "lone surrogate"),
    ("/v1/completions", {**COMPLETION, "separator": "\udc00"}, "separator", ""),  # pydantic refuses it itself
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "body", "field", "fragment"), BAD_INPUTS)
def test_inputs_that_were_500s_are_422_naming_the_field(
    client: httpx.Client, path: str, body: dict, field: str, fragment: str, stream: bool
) -> None:
    response = post(client, path, {**body, "stream": stream})
    openai_route = path == "/v1/completions"  # OpenAI's routes answer 400, as vLLM does
    assert response.status_code == (400 if openai_route else 422), response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == field
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
    assert error["message"].startswith(f"{field}") and fragment in error["message"], error["message"]
    after = post(client, "/v1/ask", ASK)  # the same kept-alive connection serves the next request
    assert after.status_code == 200 and connection_of(after) == connection_of(response)


def test_documents_with_a_lone_surrogate_are_422(client: httpx.Client) -> None:
    for document, field in [({"id": "d", "text": "Bad \ud800 text."}, "documents[0].text"),
                            ({"id": "\udfffd", "text": "Text."}, "documents[0].id"),
                            ({"id": "d", "text": "Text.", "metadata": {"k": ["\ud800"]}}, "documents[0].metadata")]:
        response = post(client, "/v1/documents", {"documents": [document]})
        assert response.status_code == 422 and response.json()["error"]["param"] == field, response.text


def test_largest_seed_is_accepted(client: httpx.Client) -> None:
    body = {**COMPLETION, "temperature": 1.0, "seed": 2**64 - 1}
    first, second = post(client, "/v1/completions", body), post(client, "/v1/completions", body)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [1e-45, 5e-324])
def test_a_tiny_temperature_answers_as_greedy(client: httpx.Client, temperature: float) -> None:
    greedy_answer = post(client, "/v1/ask", ASK).json()["answer"]
    tiny = post(client, "/v1/ask", {**ASK, "temperature": temperature, "top_p": 0.5})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["answer"] == greedy_answer
    tokens, done = ask_stream(client, {**ASK, "temperature": temperature})
    assert "".join(tokens) == done["answer"] == greedy_answer
    greedy_text = post(client, "/v1/completions", COMPLETION).json()["choices"][0]["text"]
    tiny = post(client, "/v1/completions", {**COMPLETION, "temperature": temperature})
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy_text
    deltas, _ = completion_stream(client, {**COMPLETION, "temperature": temperature})
    assert "".join(deltas) == greedy_text


# ----------------------------------------------------------------------------------------------------------- keep-alive
def _chunked_oversize():
    yield b'{"question": "'
    for _ in range(40):
        yield b"y" * 1_000
    yield b'"}'


def test_the_connection_survives_every_error_response(client: httpx.Client) -> None:
    """Each error, then a valid request, all on one kept-alive connection (a 500 used to drop it: reset)."""
    json_header = {"content-type": "application/json"}
    errors = [
        (500, lambda: client.post(UNHANDLED)),
        (400, lambda: post(client, "/v1/ask", {"question": "  "})),
        (400, lambda: post(client, "/v1/completions", {"prompt": "Hi?", "mode": "turbo"})),
        (404, lambda: client.get("/v1/nothing-here")),
        (405, lambda: client.get("/v1/ask")),
        (413, lambda: client.post("/v1/ask", content=b"x" * 20_000, headers=json_header)),
        (413, lambda: client.post("/v1/ask", content=_chunked_oversize(), headers=json_header)),
        (413, lambda: post(client, "/v1/ask", {"question": "why " * 200})),
        (422, lambda: post(client, "/v1/ask", {**ASK, "seed": 2**64})),
        (422, lambda: client.post("/v1/ask", content=b'{"question": "Who?"', headers=json_header)),
        (504, lambda: post(client, "/v1/ask", {**ASK, "timeout_s": 0.000001})),
        (500, lambda: client.post(UNHANDLED)),
    ]
    first = client.get("/healthz")
    connection = connection_of(first)
    for status, send in errors:
        response = send()
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] in ERROR_CODES  # OpenAI's shape: a string naming the error
        assert response.headers.get("connection", "").lower() != "close"
        after = post(client, "/v1/completions", {**COMPLETION, "max_tokens": 2})
        assert after.status_code == 200, after.text
        assert connection_of(response) == connection_of(after) == connection, f"a {status} dropped the connection"
    metrics = client.get("/metrics").text
    counted = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.name == "hypic_requests_total" and s.labels.get("status") == "500"]
    assert sum(counted) >= 2


# ----------------------------------------------------------------------------------------------------------- randomness
def test_unseeded_sampling_is_fresh_and_a_seed_reproduces(client: httpx.Client) -> None:
    sampled = {**COMPLETION, "temperature": 1.0, "max_tokens": 8}
    unseeded = [post(client, "/v1/completions", sampled).json()["choices"][0]["text"] for _ in range(5)]
    assert len(set(unseeded)) > 1, unseeded
    seeded = [post(client, "/v1/completions", {**sampled, "seed": 42}).json()["choices"][0]["text"] for _ in range(3)]
    assert len(set(seeded)) == 1, seeded
    ask_sampled = {**ASK, "temperature": 1.0, "max_new_tokens": 8}
    answers = [post(client, "/v1/ask", ask_sampled).json()["answer"] for _ in range(5)]
    assert len(set(answers)) > 1, answers
    seeded = [post(client, "/v1/ask", {**ask_sampled, "seed": 7}).json()["answer"] for _ in range(3)]
    assert len(set(seeded)) == 1, seeded


# -------------------------------------------------------------------------------------------------------------- streams
@pytest.mark.parametrize("document", ["lavender.md", "volcano.md", "astronomy.md"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.2, "seed": 3}])
def test_ask_stream_deltas_equal_the_answer(client: httpx.Client, document: str, sampling: dict) -> None:
    body = {**ASK, "question": SMALL_CORPUS_QUESTIONS[document], "max_new_tokens": 10, **sampling}
    plain = post(client, "/v1/ask", body).json()["answer"]
    tokens, done = ask_stream(client, body)
    assert "".join(tokens) == done["answer"] == plain
    assert all(tokens), "empty token events"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.2, "seed": 5}])
def test_completion_stream_deltas_equal_the_text(client: httpx.Client, sampling: dict) -> None:
    body = {**COMPLETION, "max_tokens": 16, **sampling}
    text = post(client, "/v1/completions", body).json()["choices"][0]["text"]
    deltas, _ = completion_stream(client, body)
    assert "".join(deltas) == text
    for stop in {text[i : i + 2] for i in range(1, min(len(text) - 1, 8))}:  # stops cutting the text, spanning tokens
        cut = post(client, "/v1/completions", {**body, "stop": stop}).json()["choices"][0]["text"]
        assert cut == text[: text.find(stop)], (stop, cut)
        deltas, _ = completion_stream(client, {**body, "stop": stop})
        assert "".join(deltas) == cut, (stop, deltas)


# ----------------------------------------------------------------------------------------------------------- accounting
def _token_totals(client: httpx.Client) -> dict[str, float]:
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "hypic_tokens_total":
                totals[sample.labels["kind"]] = sample.value
    return totals


def test_cached_tokens_count_only_what_was_reused_from_before(client: httpx.Client) -> None:
    fresh = [f"Fresh segment {uuid.uuid4().hex} about a lighthouse.", f"Another {uuid.uuid4().hex} keeper."]
    body = {**COMPLETION, "prompt": DEFAULT_SEPARATOR.join([*fresh, "Who keeps it?"])}
    before = _token_totals(client)
    cold = post(client, "/v1/completions", body).json()
    after_cold = _token_totals(client)
    warm = post(client, "/v1/completions", body).json()
    after_warm = _token_totals(client)
    for result in (cold, warm):
        usage = result["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["cached_tokens"]
        assert usage["cached_tokens"] + usage["encoded_tokens"] + usage["recomputed_tokens"] == usage["prompt_tokens"]
    assert cold["usage"]["cache_misses"] == 2 and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["usage"]["encoded_tokens"] > 0
    assert warm["usage"]["cache_hits"] == 2 and warm["usage"]["encoded_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == cold["usage"]["encoded_tokens"]
    assert after_cold["cached"] == before["cached"]
    assert after_cold["encoded"] - before["encoded"] == cold["usage"]["encoded_tokens"]
    assert after_warm["cached"] - after_cold["cached"] == warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after_warm["encoded"] == after_cold["encoded"]
    deltas, final = completion_stream(client, body)
    assert final["usage"]["encoded_tokens"] == 0 and final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_ask_usage_separates_encoded_from_cached(client: httpx.Client) -> None:
    # transition mode uses seam-0 entries, which precompute (seam 8) did not make: the first ask encodes them
    body = {**ASK, "question": SMALL_CORPUS_QUESTIONS["bicycles.md"], "top_k": 3, "mode": "transition"}
    cold = post(client, "/v1/ask", body).json()["usage"]
    warm = post(client, "/v1/ask", body).json()["usage"]
    for usage in (cold, warm):
        assert usage["cached_tokens"] + usage["encoded_tokens"] + usage["recomputed_tokens"] == usage["prompt_tokens"]
    assert cold["cache_misses"] == 3 and cold["encoded_tokens"] > 0
    assert warm["cache_misses"] == 0 and warm["encoded_tokens"] == 0
    assert warm["cached_tokens"] == cold["cached_tokens"] + cold["encoded_tokens"]
    tokens, done = ask_stream(client, body)
    assert done["usage"] == warm
