"""One vocabulary on every surface: the same field names for the same things in `hypic-rag ask --json`, `/v1/ask`
(JSON and its stream) through a real server on 127.0.0.1, the OpenAI routes' extensions and error bodies,
LlamaIndex's node and response metadata, and `docs/CONTRACTS.md`, all read against `hypic_rag/pipeline/vocabulary.py`; the
same question gives the same sources on the command line and over REST; a source the neighbour expansion brought
names the chunk that brought it on every surface."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import httpx
import pytest

from hypic_rag.cli.main import main
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, build_index, write_corpus
from hypic_rag.pipeline.vocabulary import (
    LOCATION_FIELDS,
    MATCHING_FIELDS,
    PROMPT_PART_FIELDS,
    PROMPT_PARTS,
    SOURCE_FIELDS,
    TIMING_STAGES,
    USAGE_FIELDS,
    source_record,
)

QUESTION = SMALL_CORPUS_QUESTIONS["chess.md"]
TOP_K = 3
ERROR_FIELDS = ["message", "type", "param", "code"]
CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "CONTRACTS.md"


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> dict[str, object]:
    """What each surface answers for `QUESTION`: the CLI's JSON, then a real server's answers and errors."""
    index = copy_tiny_index(tmp_path_factory.mktemp("field_names") / "index")
    captured: dict[str, object] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ask", "--index", str(index), QUESTION, "--json", "--top-k", str(TOP_K), "--max-new-tokens", "2",
                     "--device", "cpu"])
    assert code == 0, out.getvalue()
    captured["cli"] = json.loads(out.getvalue())
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running, \
            httpx.Client(base_url=running.url, timeout=120) as client:
        ask = {"question": QUESTION, "top_k": TOP_K, "max_new_tokens": 2}
        captured["ask"] = client.post("/v1/ask", json=ask).json()
        with client.stream("POST", "/v1/ask", json={**ask, "stream": True}) as stream:
            frames = stream.read().decode().strip().split("\n\n")
        captured["ask_events"] = [json.loads(frame[len("data: "):]) for frame in frames[:-1]]
        captured["completion"] = client.post("/v1/completions", json={"prompt": SMALL_CORPUS["chess.md"] + "\nWho?",
                                                                      "max_tokens": 2}).json()
        chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
        captured["chat"] = client.post("/v1/chat/completions", json=chat).json()
        captured["unknown_model"] = client.post("/v1/chat/completions", json={**chat, "model": "gpt-4o"})
        captured["bad_field"] = client.post("/v1/ask", json={**ask, "top_k": 0})
        captured["bad_type"] = client.post("/v1/completions", json={"prompt": "Who?", "max_tokens": "two"})
    return captured


def test_cli_json_and_v1_ask_name_sources_usage_and_timings_alike(surfaces: dict) -> None:
    cli, rest = surfaces["cli"], surfaces["ask"]
    for answer in (cli, rest):
        assert [list(source) for source in answer["sources"]] == [list(SOURCE_FIELDS)] * len(answer["sources"])
        assert sorted(answer["usage"]) == sorted(USAGE_FIELDS)
        assert {"answer", "sources", "mode", "recompute_policy", "finish_reason", "usage", "timings"} <= set(answer)
    assert set(TIMING_STAGES) <= set(cli["timings"])  # seconds
    assert set(rest["timings"]) == {f"{stage}_ms" for stage in TIMING_STAGES} | {"queue_ms"}  # milliseconds
    # the same sources, field for field (scores to float32 precision)
    assert [source["rank"] for source in cli["sources"]] == list(range(1, TOP_K + 1))
    for on_cli, on_rest in zip(cli["sources"], rest["sources"], strict=True):
        assert {k: v for k, v in on_cli.items() if k not in ("score", "hop_score")} == \
            {k: v for k, v in on_rest.items() if k not in ("score", "hop_score")}
        assert on_cli["score"] == pytest.approx(on_rest["score"], abs=1e-6)
    events = surfaces["ask_events"]
    assert events[0]["type"] == "sources" and events[0]["sources"] == rest["sources"]
    assert sorted(events[-1]["usage"]) == sorted(USAGE_FIELDS)
    # the prompt part by part, named alike everywhere; its counts add up to the usage's
    chunk_ids = {source["chunk_id"] for source in rest["sources"]}
    for answer in (cli, rest, events[-1]):
        parts = answer["prompt_parts"]
        assert [list(part) for part in parts] == [list(PROMPT_PART_FIELDS)] * len(parts)
        assert [part["part"] for part in parts] == ["prefix"] + ["chunk"] * TOP_K + ["question"]
        assert {part["chunk_id"] for part in parts if part["part"] == "chunk"} == chunk_ids
        assert set(part["part"] for part in parts) <= set(PROMPT_PARTS)
        for name in ("recomputed_tokens", "cached_tokens", "encoded_tokens"):
            assert sum(part[name] for part in parts) == answer["usage"][name], name
        assert sum(part["tokens"] for part in parts) == answer["usage"]["prompt_tokens"]
    assert rest["prompt_parts"] == events[-1]["prompt_parts"]


@pytest.fixture(scope="module")
def neighbour_surfaces(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, object]:
    """What each surface answers for `QUESTION` over `SMALL_CORPUS` cut into 16-token chunks (about four per
    document) and searched with `next:1` neighbour expansion, top 3, no retrieval hop: the best hit (the chess
    club's first chunk) brings its next chunk into the third place. The pipeline's `Answer`, `ask --json`,
    `ask`'s text, a real server's `/v1/ask` JSON and its stream's events."""
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.runtime.sampling import SamplingParams

    index = build_index(tmp_path_factory.mktemp("neighbour_sources") / "index", tiny_model, SMALL_CORPUS,
                        chunk_tokens=16)
    captured: dict[str, object] = {}
    with RagPipeline.open(index, device="cpu", hop_slots=0, neighbours="next:1") as pipeline:
        answer = pipeline.answer(QUESTION, top_k=TOP_K, params=SamplingParams(max_new_tokens=2))
    captured["pipeline"] = [source_record(source, rank) for rank, source in enumerate(answer.sources, start=1)]
    ask = ["ask", "--index", str(index), QUESTION, "--top-k", str(TOP_K), "--hop-slots", "0", "--neighbours", "next:1",
           "--max-new-tokens", "2", "--device", "cpu"]
    for name, extra in (("cli", ["--json"]), ("cli_text", [])):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(ask + extra)
        assert code == 0, out.getvalue()
        captured[name] = out.getvalue()
    captured["cli"] = json.loads(captured["cli"])["sources"]
    with ServerThread(ServerConfig(index_dir=index, device="cpu", hop_slots=0, neighbours="next:1")) as running, \
            httpx.Client(base_url=running.url, timeout=120) as client:
        request = {"question": QUESTION, "top_k": TOP_K, "max_new_tokens": 2}
        captured["ask"] = client.post("/v1/ask", json=request).json()["sources"]
        with client.stream("POST", "/v1/ask", json={**request, "stream": True}) as stream:
            frames = stream.read().decode().strip().split("\n\n")
        events = [json.loads(frame[len("data: "):]) for frame in frames[:-1]]
        assert events[0]["type"] == "sources", events[0]
        captured["ask_stream"] = events[0]["sources"]
    return captured


def test_a_brought_neighbour_names_the_hit_that_brought_it_on_every_surface(neighbour_surfaces: dict) -> None:
    marks = {}
    for surface in ("pipeline", "cli", "ask", "ask_stream"):
        sources = neighbour_surfaces[surface]
        assert [list(source) for source in sources] == [list(SOURCE_FIELDS)] * TOP_K, surface
        brought = [source for source in sources if source["neighbour_of"] is not None]
        assert len(brought) == 1, (surface, sources)  # the best hit's next chunk; the direct hits have none (null)
        bringer = next(source for source in sources if source["chunk_id"] == brought[0]["neighbour_of"])
        assert bringer["neighbour_of"] is None and bringer["rank"] == 1, (surface, sources)
        assert (brought[0]["doc_id"], brought[0]["position"]) == (bringer["doc_id"], bringer["position"] + 1)
        marks[surface] = [(source["chunk_id"], source["neighbour_of"]) for source in sources]
    assert marks["pipeline"] == marks["cli"] == marks["ask"] == marks["ask_stream"]
    # ask's text: the brought source marked `neighbour`, the line under it naming the source that brought it
    text = neighbour_surfaces["cli_text"]
    source = next(source for source in neighbour_surfaces["cli"] if source["neighbour_of"] is not None)
    lines = text.splitlines()
    at = next(number for number, line in enumerate(lines) if line.startswith(f"  [{source['rank']}] "))
    assert re.match(rf"  \[{source['rank']}\] {re.escape(source['doc_id'])} #{source['position']} \(score [\d.]+, "
                    r"neighbour\): ", lines[at]), lines[at]
    assert lines[at + 1] == (f"      neighbour: the chunk after [1] {source['doc_id']} #{source['position'] - 1} in "
                             f"its document, brought by that hit (chunk {source['neighbour_of']}), not by the question")
    assert sum(", neighbour)" in line for line in lines) == 1


def test_openai_routes_carry_the_same_usage_names_and_openai_error_bodies(surfaces: dict) -> None:
    for response in (surfaces["completion"], surfaces["chat"]):
        usage = response["usage"]
        assert set(USAGE_FIELDS) | set(MATCHING_FIELDS) <= set(usage), usage
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["cached_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert sorted(response["hypic"]) == ["mode", "timings"]  # the counters live in usage only
    unknown = surfaces["unknown_model"]
    assert unknown.status_code == 404
    assert list(unknown.json()["error"]) == ERROR_FIELDS
    assert unknown.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                           "param": "model", "code": "model_not_found"}
    for response, status, code in ((surfaces["bad_field"], 422, "invalid_value"),
                                   (surfaces["bad_type"], 400, "invalid_type")):
        error = response.json()["error"]
        assert response.status_code == status and list(error)[:4] == ERROR_FIELDS
        assert (error["type"], error["code"]) == ("invalid_request_error", code)


def test_llama_index_metadata_uses_the_same_document_names(surfaces: dict, tmp_path: Path, tiny_model: Path) -> None:
    """Nodes read through `file_extractors()` carry `doc_id` and `source` with the values the CLI and `/v1/ask`
    give the same document (and LlamaIndex's `file_name` / `file_path`); a query engine's usage and an LLM
    completion's use the vocabulary's names."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import SimpleDirectoryReader, VectorStoreIndex

    from hypic_rag.integrations.llama_index import HypicEmbedding, HypicLLM, HypicQueryEngine
    from hypic_rag.integrations.llama_index_reader import file_extractors

    corpus = write_corpus(tmp_path / "corpus", SMALL_CORPUS)
    documents = SimpleDirectoryReader(str(corpus), file_extractor=file_extractors()).load_data()
    rest_source = surfaces["ask"]["sources"][0]
    node_metadata = next(d.metadata for d in documents if d.metadata["doc_id"] == rest_source["doc_id"])
    assert node_metadata["source"] == rest_source["source"] == surfaces["cli"]["sources"][0]["source"]
    assert node_metadata["file_name"] == Path(node_metadata["file_path"]).name == rest_source["doc_id"]
    assert not set(node_metadata) & (set(SOURCE_FIELDS) - {"doc_id", "source"})  # no look-alike names
    llm = HypicLLM(model_path=str(tiny_model), device="cpu", max_new_tokens=2)
    try:
        completion = llm.complete(SMALL_CORPUS["chess.md"] + "\nWho?")
        assert set(USAGE_FIELDS) | set(MATCHING_FIELDS) == set(completion.raw["usage"])
        retriever = VectorStoreIndex.from_documents(documents, embed_model=HypicEmbedding()).as_retriever()
        response = HypicQueryEngine(retriever=retriever, llm=llm).query(QUESTION)
        assert sorted(response.metadata["usage"]) == sorted(USAGE_FIELDS)
        assert set(TIMING_STAGES) <= set(response.metadata["timings"])
    finally:
        llm.runtime.close()


def test_the_contracts_page_names_every_field() -> None:
    text = CONTRACTS.read_text(encoding="utf-8")
    section = text[text.index("## Field names"):]
    named = set(re.findall(r"`([a-z_]+)`", section))
    missing = [name for name in (*SOURCE_FIELDS, *LOCATION_FIELDS, *USAGE_FIELDS, *MATCHING_FIELDS, *TIMING_STAGES,
                                 "prompt_parts", *PROMPT_PART_FIELDS, *PROMPT_PARTS,
                                 "model_not_found", "invalid_request_error") if name not in named]
    assert not missing, f"docs/CONTRACTS.md 'Field names' does not name {missing}"
