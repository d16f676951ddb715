"""precompute, ask, serve and the LlamaIndex integration unchanged on every family beyond Qwen, through stand-ins of
their hub checkpoints in the published layout (tiny random weights, a trained BPE tokenizer).

- One family per mixer kind (SSD, Mamba1, KDA, lightning, a delta-rule variant, short conv) goes through
  `hypic-rag precompute` and `ask --json`: KDA + MLA in real `python -m hypic_rag` processes (the one end-to-end
  process test of this path), the others through the CLI's `main` in this process (the same argv); the answer
  (text, sources, finish reason) equals the in-process pipeline's (`RagPipeline`, greedy) on the same index, and
  every chunk came from the cache.
- The other families (Granite 4.0-H, Bamba, Nemotron-H, Zamba2, Ling) load with `load_model` and answer through an
  index built by the library's precompute, all chunks cached: the same code without the process boundary.
- `serve` answers `/v1/ask` and `/v1/chat/completions` on two of the indices, equal to the in-process pipeline and
  session: KDA + MLA through a real `serve` process on 127.0.0.1, Mamba1 + NoPE through the same uvicorn server in
  a thread of this process (`ServerThread`).
- LlamaIndex's `HypicQueryEngine` answers over a Zamba2 stand-in, equal to the runtime generating over the same
  nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from hypic_rag.prompting.chat import ChatMessage, chat_prompt
from hypic_rag.pipeline.answering import Answer, RagPipeline
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from hypic_rag.testing import free_port, save_tiny_checkpoint, train_tiny_tokenizer
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, build_index, write_corpus
from kits.published import save_lfm2_checkpoint, save_linear_family_checkpoint
from hypic_rag.cli.in_process import run_cli_here
from hypic_rag.testing.ssm import save_published_ssm_checkpoint

pytestmark = pytest.mark.slow  # 3 processes (KDA + MLA); the other families run the CLI in this process

ROOT = Path(__file__).resolve().parents[2]
TEXTS = (list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())) * 4
QUESTION = SMALL_CORPUS_QUESTIONS["volcano.md"]
TOP_K, NEW_TOKENS, CHUNK_TOKENS = 3, 6, 48

CLI_FAMILIES = {  # one family per mixer kind: precompute and ask (real processes for PROCESS_FAMILY)
    "falcon_h1": "SSD (parallel with RoPE attention)",
    "jamba": "Mamba1 (vector transition)",
    "kimi_linear": "KDA (matrix) + MLA",
    "minimax": "lightning (scalar, no conv)",
    "olmo_hybrid": "Gated DeltaNet with b in [0, 2]",
    "lfm2": "short conv (no state)",
}
IN_PROCESS_FAMILIES = ("granitemoehybrid", "bamba", "nemotron_h", "zamba2", "bailing_hybrid")
PROCESS_FAMILY = "kimi_linear"
SERVED = ("kimi_linear", "jamba")  # kimi_linear by a real `serve` process, jamba by a server thread here


def stand_in(family: str, directory: Path) -> Path:
    """A shrunken stand-in of the family's hub checkpoint in its published layout (Granite 4.0-H publishes under
    transformers' own names)."""
    if family in ("jamba", "bamba", "nemotron_h", "falcon_h1", "zamba2"):
        return save_published_ssm_checkpoint(directory, train_tiny_tokenizer(TEXTS), kind=family)[0]
    if family in ("kimi_linear", "bailing_hybrid", "olmo_hybrid", "minimax"):
        return save_linear_family_checkpoint(directory, TEXTS, model_type=family)[0]
    if family == "lfm2":
        return save_lfm2_checkpoint(directory, TEXTS)[0]
    return save_tiny_checkpoint(directory, TEXTS, model_type=family)


def child_environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}


def hypic(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m hypic_rag ARGV` in a real process, this checkout first on the path."""
    return subprocess.run([sys.executable, "-m", "hypic_rag", *argv], capture_output=True, text=True, timeout=300,
                          env=child_environment(), check=False)


def in_process_answer(index: Path, question: str = QUESTION) -> Answer:
    pipeline = RagPipeline.open(index, device="cpu")
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_strings=(pipeline.prompt_format.answer_stop,))
        return pipeline.answer(question, top_k=TOP_K, params=params)
    finally:
        pipeline.close()


def sources_of(answer: dict[str, Any]) -> list[tuple[str, str]]:
    """(document, chunk id) of each source, best first (`ask --json` names the document `doc_id`, `/v1/ask`
    `document`)."""
    return [(source.get("doc_id", source.get("document")), source["chunk_id"]) for source in answer["sources"]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("families_corpus"), SMALL_CORPUS)


@pytest.fixture(scope="module")
def cli_indices(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Per CLI family: its index (written by `precompute`) and `ask --json`'s answer; real processes for
    PROCESS_FAMILY (in a thread, while the others run the CLI's `main` in this process)."""
    work = tmp_path_factory.mktemp("families_cli")

    def run_family(family: str) -> tuple[Path, dict[str, Any]]:
        run = hypic if family == PROCESS_FAMILY else run_cli_here
        model = stand_in(family, work / family / "model")
        index = work / family / "index"
        built = run("precompute", str(corpus), "--index", str(index), "--model", str(model), "--chunk-tokens",
                      str(CHUNK_TOKENS), "--device", "cpu", "--no-progress")
        assert built.returncode == 0, f"{family}: {built.stderr[-2000:]}"
        asked = run("ask", QUESTION, "--index", str(index), "--top-k", str(TOP_K), "--max-new-tokens",
                      str(NEW_TOKENS), "--device", "cpu", "--json")
        assert asked.returncode == 0, f"{family}: {asked.stderr[-2000:]}"
        return index, json.loads(asked.stdout)

    with ThreadPoolExecutor(max_workers=1) as pool:
        in_processes = pool.submit(run_family, PROCESS_FAMILY)
        done = {family: run_family(family) for family in CLI_FAMILIES if family != PROCESS_FAMILY}
        done[PROCESS_FAMILY] = in_processes.result()
    return done


@pytest.mark.parametrize("family", list(CLI_FAMILIES))
def test_precompute_and_ask_processes_answer_as_the_in_process_pipeline(
    cli_indices: dict[str, tuple[Path, dict[str, Any]]], family: str
) -> None:
    index, asked = cli_indices[family]
    assert json.loads((index / "manifest.json").read_text())["model"]["path"]  # precompute recorded its model
    expected = in_process_answer(index)
    assert asked["mode"] == "hypic" and asked["answer"] == expected.text
    assert asked["finish_reason"] == expected.finish_reason
    assert sources_of(asked) == [(source.doc_id, source.chunk_id) for source in expected.sources]
    assert "volcano.md" in [source["doc_id"] for source in asked["sources"]]
    usage = asked["usage"]
    assert usage["encoded_tokens"] == 0 and usage["cached_tokens"] > 0  # every chunk's entry from the cache
    assert usage["completion_tokens"] == len(expected.token_ids) >= 1


@pytest.mark.parametrize("family", IN_PROCESS_FAMILIES)
def test_the_other_families_load_and_answer_from_a_precomputed_index(tmp_path: Path, corpus: Path,
                                                                     family: str) -> None:
    from hypic_rag.runtime.model import load_model

    model_dir = stand_in(family, tmp_path / "model")
    model = load_model(model_dir, device="cpu", require_tokenizer=True)
    assert model.config.model_type == family and model.tokenizer is not None
    index = build_index(tmp_path / "index", model_dir, corpus, chunk_tokens=CHUNK_TOKENS)
    answer = in_process_answer(index)
    assert answer.mode == "hypic" and answer.finish_reason in ("length", "stop") and answer.token_ids
    assert answer.usage["encoded_tokens"] == 0 and answer.usage["cached_tokens"] > 0
    assert "volcano.md" in [source.doc_id for source in answer.sources]


def serving(index: Path) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port", str(port), "--device", "cpu",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_environment(),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.kill()
    raise AssertionError(f"serve did not come up: {server.communicate(timeout=30)}")


def stopped(server: subprocess.Popen[str]) -> str:
    server.send_signal(signal.SIGTERM)
    _, stderr = server.communicate(timeout=120)
    assert server.returncode == 0, stderr
    return stderr


def in_process_chat(index: Path, documents: list[str], question: str) -> str:
    """What `/v1/chat/completions` should answer for one user message of document parts and a question (no
    segment matching): the session's chat prompt, greedy, through the in-process engine."""
    pipeline = RagPipeline.open(index, device="cpu")
    try:
        messages = [ChatMessage.of("user", [*documents, question], "<<PIC_SEP>>")]
        prompt = chat_prompt(pipeline.tokenizer, messages, pipeline.prompt_format, None)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_strings=prompt.stop_strings)
        return pipeline.engine.generate(prompt.request, "hypic", params).text
    finally:
        pipeline.close()


@pytest.mark.parametrize("family", SERVED)
def test_serve_answers_ask_and_chat_as_in_process(cli_indices: dict[str, tuple[Path, dict[str, Any]]],
                                                  family: str) -> None:
    index, asked = cli_indices[family]
    documents = [SMALL_CORPUS["chess.md"], SMALL_CORPUS["volcano.md"]]
    question = SMALL_CORPUS_QUESTIONS["chess.md"]
    expected_chat = in_process_chat(index, documents, question)
    if family != PROCESS_FAMILY:
        with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
            check_served_answers(running.url, asked, documents, question, expected_chat)
        return
    server, url = serving(index)
    try:
        check_served_answers(url, asked, documents, question, expected_chat)
    finally:
        stderr = stopped(server)
    assert "Traceback" not in stderr, stderr


def check_served_answers(url: str, asked: dict[str, Any], documents: list[str], question: str,
                         expected_chat: str) -> None:
    """`/v1/ask` answers as `ask --json` did; `/v1/chat/completions` as the in-process session."""
    with httpx.Client(base_url=url, timeout=120) as client:
        answered = client.post("/v1/ask", json={"question": QUESTION, "top_k": TOP_K,
                                                "max_new_tokens": NEW_TOKENS})
        assert answered.status_code == 200, answered.text
        answer = answered.json()
        assert answer["answer"] == asked["answer"] and sources_of(answer) == sources_of(asked)
        assert answer["usage"]["encoded_tokens"] == 0
        content = [{"type": "text", "text": text} for text in (*documents, question)]
        chatted = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": NEW_TOKENS, "temperature": 0,
            "match_segments": False})
        assert chatted.status_code == 200, chatted.text
        reply = chatted.json()
        assert reply["choices"][0]["message"]["content"] == expected_chat
        assert reply["usage"]["completion_tokens"] >= 1


def test_llama_index_query_engine_answers_over_a_zamba2_stand_in(tmp_path: Path) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.schema import MetadataMode

    from hypic_rag.integrations.llama_index import HypicEmbedding, HypicLLM, HypicQueryEngine
    from hypic_rag.integrations.llama_index.layout import document_order

    model_dir = stand_in("zamba2", tmp_path / "model")
    llm = HypicLLM(model_path=str(model_dir), cache_dir=str(tmp_path / "cache"), device="cpu",
                   max_new_tokens=NEW_TOKENS)
    try:
        runtime = llm.runtime
        assert runtime.model.config.model_type == "zamba2"
        documents = [Document(text=text, id_=name, metadata={"file_name": name}) for name, text in SMALL_CORPUS.items()]
        nodes = SentenceSplitter(chunk_size=CHUNK_TOKENS, chunk_overlap=0, tokenizer=runtime.tokenize)(documents)
        index = VectorStoreIndex(nodes, embed_model=HypicEmbedding())
        engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm)
        for question in (QUESTION, SMALL_CORPUS_QUESTIONS["chess.md"]):
            response = engine.query(question)
            laid_out = document_order(response.source_nodes)  # the prompt's order: a document's nodes as written
            texts = [item.node.get_content(metadata_mode=MetadataMode.NONE) for item in laid_out]
            expected = runtime.generate(runtime.rag_request(texts, question), "hypic", llm.sampling())
            assert response.response == expected.text.strip()
            assert response.metadata["usage"]["completion_tokens"] == len(expected.token_ids)
        again = engine.query(QUESTION)  # the same nodes again: every segment from the cache
        assert again.metadata["usage"]["cache_misses"] == 0
    finally:
        llm.runtime.close()

