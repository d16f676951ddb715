"""What a client can make the server store is bounded, against a real uvicorn server on 127.0.0.1 (tiny model):
30 asks naming 30 different `seam@W` policies add no cache entry (a seam the index was not built for is refused,
naming the seams it holds; one at least as long as the longest chunk is the plan that recomputes every chunk whole,
served without reading or storing any entry); they used to add 480 entries (154 MiB) that nothing else would read.
A seam at least as long as its chunk is planned as a whole chunk everywhere (`RecomputePlan.normalised`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hypic_rag.retrieval.corpus_index import DOCSTORE_FILE
from hypic_rag.retrieval.docstore import DocStore
from hypic_rag.runtime.recompute_policy import WHOLE, RecomputePlan, RecomputePolicy
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread

SEAM = 8
QUESTION = "Where does the river flow?"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("cache_growth") / "index")


@pytest.fixture(scope="module")
def longest(index: Path) -> int:
    store = DocStore(index / DOCSTORE_FILE)
    try:
        return store.counts().longest_chunk
    finally:
        store.close()


@pytest.fixture(scope="module")
def client(index: Path) -> Iterator[httpx.Client]:
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        with httpx.Client(base_url=running.url, timeout=120) as http:
            yield http


def entries(client: httpx.Client) -> int:
    return int(client.get("/v1/cache/stats").json()["cache"]["entries"])


def ask(client: httpx.Client, policy: str | None = None) -> httpx.Response:
    body = {"question": QUESTION, "top_k": 4, "max_new_tokens": 2}
    return client.post("/v1/ask", json=body if policy is None else {**body, "recompute_policy": policy})


def test_a_seam_at_least_as_long_as_its_chunk_is_the_whole_chunk() -> None:
    plan = RecomputePolicy.parse("seam@12").plan([20, 12, 5, 13], SEAM)
    assert plan.normalised([20, 12, 5, 13]).chunk_seams == (12, WHOLE, WHOLE, 12)
    assert RecomputePlan((WHOLE, 0)).normalised([4, 4]).chunk_seams == (WHOLE, 0)


def test_thirty_seams_named_by_a_client_add_no_entry(client: httpx.Client, longest: int) -> None:
    assert ask(client).status_code == 200  # the question's chunks and the prefix: held since precompute
    before = entries(client)
    refused = served = 0
    for width in [w for w in range(1, 17) if w != SEAM] + list(range(longest, longest + 15)):
        response = ask(client, f"seam@{width}")
        if width < longest:
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "recompute_policy" and f"holds entries for seam {SEAM} only" in error["message"]
            assert f"at least {longest}" in error["message"]
            refused += 1
        else:
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            assert usage["cache_hits"] == 1 and usage["cache_misses"] == 0  # the prefix only: no chunk entry read
            served += 1
    assert (refused, served) == (15, 15)
    assert entries(client) == before


def test_a_whole_seam_answers_as_recomputing_every_chunk(client: httpx.Client, longest: int) -> None:
    wide = ask(client, f"seam@{longest + 100}").json()
    whole = ask(client, "whole:64").json()
    assert wide["answer"] == whole["answer"]
    assert wide["usage"]["recomputed_tokens"] == whole["usage"]["recomputed_tokens"]
    assert ask(client, f"whole:2@{SEAM}").status_code == 200 and ask(client, "budget:2").status_code == 200
    assert ask(client, "whole:2@3").status_code == 400  # the seam of the chunks not recomputed whole, too
