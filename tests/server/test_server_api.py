"""The REST service end to end: a real uvicorn server on 127.0.0.1 over a precomputed index, driven with httpx.

Uses a tiny random model (answers are gibberish, so correctness of answers is checked in
test_server_default_model.py); retrieval, streaming framing, token accounting, cache reuse, documents, jobs,
stats and metrics are all real.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS

SEAM = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index):
    index = copy_tiny_index(tmp_path_factory.mktemp("server_api") / "index")
    assert json.loads((index / "manifest.json").read_text())["seam_tokens"] == SEAM
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        yield running


@pytest.fixture()
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def sse_events(body: str) -> list[str]:
    """The data payloads of an SSE body; asserts the framing (one `data:` line per event, blank-line ended)."""
    assert body.endswith("\n\n"), "an SSE body ends with a blank line"
    frames = body[:-2].split("\n\n")
    payloads = []
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, f"bad SSE frame {frame!r}"
        payloads.append(frame[len("data: "):])
    return payloads


def ask(client: httpx.Client, question: str, **options) -> dict:
    response = client.post("/v1/ask", json={"question": question, "max_new_tokens": 6, **options})
    assert response.status_code == 200, response.text
    return response.json()


# ------------------------------------------------------------------------------------------------ health and docs
def test_healthz_reports_ready_with_index_counts(client: httpx.Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    health = response.json()
    assert health["status"] == "ok"
    assert health["documents"] == len(SMALL_CORPUS) and health["chunks"] >= len(SMALL_CORPUS)
    assert health["queue_capacity"] == 64 and health["read_only"] is False


def test_openapi_page_lists_every_endpoint(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path in ("/v1/ask", "/v1/completions", "/v1/documents", "/v1/jobs/{job_id}", "/v1/cache/stats",
                 "/healthz", "/metrics", "/v1/documents/{doc_id}"):
        assert path in spec["paths"], path
    assert "AskRequest" in spec["components"]["schemas"]
    page = client.get("/docs")
    assert page.status_code == 200 and "/openapi.json" in page.text and "cdn" not in page.text.lower()


# ------------------------------------------------------------------------------------------------ /v1/ask
@pytest.mark.parametrize("document", ["astronomy.md", "volcano.md"])
def test_ask_returns_sources_usage_and_timings(client: httpx.Client, document: str) -> None:
    answer = ask(client, SMALL_CORPUS_QUESTIONS[document], top_k=3)
    sources = answer["sources"]
    assert len(sources) == 3
    assert sources[0]["doc_id"] == document
    assert sources[0]["text"].strip() == SMALL_CORPUS[document].strip()
    assert [s["score"] for s in sources] == sorted((s["score"] for s in sources), reverse=True)
    usage = answer["usage"]
    assert usage["cache_hits"] == 4 and usage["cache_misses"] == 0  # prefix + 3 chunks, all precomputed
    assert usage["cached_tokens"] + usage["recomputed_tokens"] == usage["prompt_tokens"]
    assert 0 < usage["recomputed_tokens"] < usage["prompt_tokens"]
    assert 1 <= usage["completion_tokens"] <= 6
    timings = answer["timings"]
    for name in ("retrieval_ms", "cache_load_ms", "compose_ms", "prefill_ms", "time_to_first_token_ms", "total_ms"):
        assert timings[name] >= 0.0, name
    assert timings["time_to_first_token_ms"] <= timings["total_ms"]
    assert answer["mode"] == "hypic"


def test_ask_modes_differ_only_in_what_they_recompute(client: httpx.Client) -> None:
    question = SMALL_CORPUS_QUESTIONS["chess.md"]
    hypic = ask(client, question, top_k=2, mode="hypic")["usage"]
    full = ask(client, question, top_k=2, mode="full")["usage"]
    transition = ask(client, question, top_k=2, mode="transition")["usage"]
    assert full["recomputed_tokens"] == full["prompt_tokens"] == hypic["prompt_tokens"]
    assert full["cached_tokens"] == 0
    # hypic recomputes a seam of SEAM tokens at the start of each retrieved chunk (the prefix sits at position 0)
    assert hypic["recomputed_tokens"] - transition["recomputed_tokens"] == 2 * SEAM
    again = ask(client, question, top_k=2, mode="transition")["usage"]
    assert again["cache_misses"] == 0 and again["cache_hits"] == 3  # seam-0 entries were stored on first use


def test_stream_frames_sources_tokens_done(client: httpx.Client) -> None:
    question = SMALL_CORPUS_QUESTIONS["lavender.md"]
    plain = ask(client, question, top_k=2)
    with client.stream("POST", "/v1/ask", json={"question": question, "top_k": 2, "max_new_tokens": 6,
                                                "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = response.read().decode()
    payloads = sse_events(body)
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert events[0]["type"] == "sources"
    assert [s["doc_id"] for s in events[0]["sources"]] == [s["doc_id"] for s in plain["sources"]]
    tokens = [e["text"] for e in events[1:-1]]
    assert all(e["type"] == "token" for e in events[1:-1]) and tokens
    done = events[-1]
    assert done["type"] == "done"
    assert "".join(tokens) == done["answer"] == plain["answer"]  # greedy: same answer either way, deltas exact
    assert done["usage"] == plain["usage"]
    assert 0 < done["timings"]["time_to_first_token_ms"] <= done["timings"]["total_ms"]


def test_a_stream_whose_client_goes_away_stops_generating(client: httpx.Client) -> None:
    body = {"question": SMALL_CORPUS_QUESTIONS["astronomy.md"], "max_new_tokens": 1000, "stream": True}
    with client.stream("POST", "/v1/ask", json=body) as response:
        for line in response.iter_lines():
            if '"type":"token"' in line:
                break  # leave after the first token: the worker must not generate the other 999
    began = time.perf_counter()
    follow_up = ask(client, SMALL_CORPUS_QUESTIONS["chess.md"], top_k=1)
    assert follow_up["timings"]["queue_ms"] < 2_000, "the abandoned stream kept the worker busy"
    assert time.perf_counter() - began < 10


def test_twenty_concurrent_asks_match_sequential_answers(client: httpx.Client, server: ServerThread) -> None:
    documents = list(SMALL_CORPUS_QUESTIONS)
    sequential = {doc: ask(client, SMALL_CORPUS_QUESTIONS[doc], top_k=2) for doc in documents}

    async def burst() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            began = time.perf_counter()
            calls = [
                http.post("/v1/ask", json={"question": SMALL_CORPUS_QUESTIONS[documents[i % len(documents)]],
                                           "top_k": 2, "max_new_tokens": 6})
                for i in range(20)
            ]
            responses = await asyncio.gather(*calls)
            return list(responses), time.perf_counter() - began

    responses, seconds = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 20
    for number, response in enumerate(responses):
        document = documents[number % len(documents)]
        answer = response.json()
        assert answer["sources"][0]["doc_id"] == document
        assert answer["answer"] == sequential[document]["answer"], "a concurrent request got another's state"
        assert answer["usage"] == sequential[document]["usage"]
    waits = sorted(r.json()["timings"]["queue_ms"] for r in responses)
    print(f"\n20 concurrent asks: {seconds:.2f} s wall, queue wait median {waits[10]:.0f} ms, max {waits[-1]:.0f} ms")


# ------------------------------------------------------------------------------------------------ /v1/completions
def completion(client: httpx.Client, prompt: str, **options) -> dict:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, **options}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_reuse_separated_segments_in_any_order(client: httpx.Client) -> None:
    first_doc, second_doc = "Kestrel Bay has a lighthouse.", "The lighthouse keeper is Ingrid Holm."
    query = "Question: Who keeps the lighthouse?\nAnswer:"
    cold = completion(client, DEFAULT_SEPARATOR.join([first_doc, second_doc, query]))
    assert cold["object"] == "text_completion" and cold["id"].startswith("cmpl-")
    assert cold["choices"][0]["finish_reason"] in ("length", "stop")
    assert cold["usage"]["segments"] == 3
    assert cold["usage"]["cache_misses"] == 2 and cold["usage"]["cache_hits"] == 0
    warm = completion(client, DEFAULT_SEPARATOR.join([first_doc, second_doc, query]))
    assert warm["usage"]["cache_hits"] == 2 and warm["usage"]["cache_misses"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    swapped = completion(client, DEFAULT_SEPARATOR.join([second_doc, first_doc, query]))
    assert swapped["usage"]["cache_hits"] == 2 and swapped["usage"]["cache_misses"] == 0  # position independent
    usage = warm["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm["usage"]["recomputed_tokens"] < usage["prompt_tokens"]


def test_completion_without_separator_is_one_recomputed_query(client: httpx.Client) -> None:
    result = completion(client, "Kestrel Bay has a lighthouse. Who keeps it?")
    assert result["usage"]["segments"] == 1
    assert result["usage"]["recomputed_tokens"] == result["usage"]["prompt_tokens"]
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_completion_separator_is_configurable_per_request(client: httpx.Client) -> None:
    result = completion(client, "Segment one is about the harbour of Kestrel Bay.|||Segment two is about its old "
                                "lighthouse and who keeps it.|||Query?", separator="|||")
    assert result["usage"]["segments"] == 3
    assert result["usage"]["cache_hits"] + result["usage"]["cache_misses"] == 2
    short = completion(client, "One.|||Two.|||Query?", separator="|||")  # segments shorter than the seam (8)
    assert short["usage"]["segments"] == 3
    assert short["usage"]["cache_hits"] + short["usage"]["cache_misses"] == 0  # recomputed whole: no entry


def test_completion_stream_is_openai_framed(client: httpx.Client) -> None:
    prompt = DEFAULT_SEPARATOR.join(["Kestrel Bay has a lighthouse.", "Who keeps it?"])
    plain = completion(client, prompt)
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_events(response.read().decode())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain["choices"][0]["text"]
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


def test_models_lists_the_served_model_and_its_index_chat(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    served = completion(client, "Hi?")["model"]
    assert models["object"] == "list" and [card["id"] for card in models["data"]] == [served, served + "+index"]
    assert client.get(f"/v1/models/{served}+index").json()["id"] == served + "+index"
    assert client.get(f"/v1/models/{served}+other").status_code == 404


# ------------------------------------------------------------------------------------------------ documents
def wait_for_job(client: httpx.Client, job_id: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s} s")


def test_add_then_query_then_delete_a_document(client: httpx.Client) -> None:
    doc_id = "pottery/orinoco.md"
    text = ("The Orinoco Pottery Guild fires its kilns with driftwood. Its members glaze every bowl in "
            "cobalt blue and sell them at the harbour fair.")
    question = "Which pottery guild fires kilns with driftwood?"
    stats_before = client.get("/v1/cache/stats").json()
    accepted = client.post("/v1/documents", json={"documents": [{"id": doc_id, "text": text,
                                                                 "metadata": {"topic": "pottery"}}]})
    assert accepted.status_code == 202
    assert accepted.headers["location"] == accepted.json()["status_url"] == f"/v1/jobs/{accepted.json()['job_id']}"
    job = wait_for_job(client, accepted.json()["job_id"])
    assert job["status"] == "succeeded", job
    assert job["progress"]["documents_indexed"] == job["progress"]["documents_total"] == 1
    assert job["progress"]["chunks_encoded"] == job["progress"]["chunks_total"] >= 1
    assert job["result"]["documents_added"] == 1
    stats_after = client.get("/v1/cache/stats").json()
    assert stats_after["cache"]["entries"] == stats_before["cache"]["entries"] + job["result"]["chunks_encoded"]
    assert stats_after["index"]["documents"] == stats_before["index"]["documents"] + 1

    answer = ask(client, question, top_k=2)
    assert answer["sources"][0]["doc_id"] == doc_id
    assert answer["sources"][0]["metadata"] == {"topic": "pottery"}
    assert answer["usage"]["cache_misses"] == 0  # the job encoded the new chunks ahead of the query

    deleted = client.delete(f"/v1/documents/{doc_id}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"doc_id": doc_id, "deleted": True, "chunks_removed": job["progress"]["chunks_total"]}
    assert doc_id not in [s["doc_id"] for s in ask(client, question, top_k=3)["sources"]]
    again = client.delete(f"/v1/documents/{doc_id}")
    assert again.status_code == 404 and doc_id in again.json()["error"]["message"]
    assert client.get("/healthz").json()["documents"] == len(SMALL_CORPUS)


def test_unknown_job_is_404(client: httpx.Client) -> None:
    response = client.get("/v1/jobs/0123456789abcdef")
    assert response.status_code == 404
    assert response.json()["error"]["param"] == "job_id"


# ------------------------------------------------------------------------------------------------ stats and metrics
def test_cache_stats_count_entries_and_this_servers_lookups(client: httpx.Client) -> None:
    ask(client, SMALL_CORPUS_QUESTIONS["bicycles.md"], top_k=2)
    stats = client.get("/v1/cache/stats").json()
    assert stats["cache"]["entries"] >= len(SMALL_CORPUS) + 1  # every chunk and the prefix
    assert stats["cache"]["value_bytes"] > 0 and stats["cache"]["linear_bytes"] > 0 and stats["cache"]["kv_bytes"] > 0
    assert stats["server"]["cache_hits"] >= 3
    assert stats["server"]["tokens"]["recomputed"] < stats["server"]["tokens"]["prompt"]
    assert stats["index"]["documents"] == len(SMALL_CORPUS)
    assert Path(stats["cache"]["path"]).name == "segment_cache"


def _samples(text: str) -> dict[str, list]:
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


def test_metrics_are_prometheus_text(client: httpx.Client) -> None:
    ask(client, SMALL_CORPUS_QUESTIONS["glassblowing.md"], top_k=2)
    client.post("/v1/ask", json={"question": ""})  # a 400, counted too
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)

    def value(name: str, **labels: str) -> float:
        matching = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
        assert matching, f"no sample {name} {labels}"
        return sum(matching)

    assert value("hypic_requests_total", route="/v1/ask", method="POST", status="200") >= 1
    assert value("hypic_requests_total", route="/v1/ask", method="POST", status="400") >= 1
    assert value("hypic_time_to_first_token_seconds_count", route="/v1/ask") >= 1
    assert value("hypic_time_to_first_token_seconds_bucket", route="/v1/ask", le="+Inf") >= 1
    assert value("hypic_segment_cache_hits_total") >= 3
    assert value("hypic_segment_cache_misses_total") >= 0
    assert value("hypic_segment_cache_bytes") > 0 and value("hypic_segment_cache_entries") >= len(SMALL_CORPUS)
    assert value("hypic_queue_depth") == 0
    assert value("hypic_queue_capacity") == 64
    assert value("hypic_tokens_total", kind="recomputed") < value("hypic_tokens_total", kind="prompt")
