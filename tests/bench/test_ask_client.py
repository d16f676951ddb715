"""The benchmarks' light load generator (`server_clients.AskClient`, http.client) against a real uvicorn server on
127.0.0.1 (tiny index): its streamed answers equal the service's own non-streamed ones, over one reused
connection; an error status raises with the server's message, and the client goes on over a new connection."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hypic_rag.bench.server_clients import AskClient
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS_QUESTIONS


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("ask_client") / "index")


def test_streamed_answers_equal_the_plain_ones_over_one_connection(index: Path) -> None:
    questions = list(SMALL_CORPUS_QUESTIONS.values())[:3]
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            plain = [http.post("/v1/ask", json={"question": q, "top_k": 2, "max_new_tokens": 6}).json()
                     for q in questions]
        client = AskClient(server.url)
        try:
            streamed = [client.ask(q, 2, 6) for q in questions]
            socket_before = client._connection.sock
            again = client.ask(questions[0], 2, 6)
            assert client._connection.sock is socket_before  # kept alive: the response was read to its end
            with pytest.raises(RuntimeError, match="HTTP 422"):
                client.ask(questions[0], 0, 6)  # top_k 0: refused by the schema
            assert client.ask(questions[1], 2, 6)[2] == streamed[1][2]  # a new connection after the error
        finally:
            client.close()
    for (ttft, tokens, (answer, sources)), expected in zip(streamed, plain):
        assert answer == expected["answer"]
        assert list(sources) == [source["chunk_id"] for source in expected["sources"]]
        assert tokens == expected["usage"]["completion_tokens"] and ttft > 0
    assert again[2] == streamed[0][2]
