"""No request waits behind a large piece of work, against a real server: a 2,000,000-character document is
indexed in bounded steps while asks are answered; a document over the per-document token limit gets 413; a
completion whose deadline passes (or whose client goes away) while its many segments are being encoded stops at
the next segment, so the following ask is answered at once and the cache does not take in every segment; a prompt
with more segments than the server accepts gets 413."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS

REQUEST_TIMEOUT_S = 5.0
PROMPT_ASK_S = 3.5
"""An ask served promptly: its own time (well under a second here) plus at most one step of other work."""
LIMITS = dict(
    request_timeout_s=REQUEST_TIMEOUT_S,
    max_segments=2_000,
    max_prompt_chars=2_000_000,
    max_prompt_tokens=600_000,
    max_document_tokens=1_000_000,
)
WORDS = ("alice marlow glass studio river farm honey comet telescope volcano island chess club library champion "
         "tournament kiln amber lavender market").split()


def prose(characters: int, seed: int) -> str:
    """Sentences of corpus words in paragraphs, `characters` long."""
    rng = random.Random(seed)
    paragraphs, size = [], 0
    while size < characters:
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))).capitalize() + "."
                     for _ in range(rng.randint(2, 6))]
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1]) + 2
    return "\n\n".join(paragraphs)[:characters]


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("server_bounded") / "index")


@pytest.fixture(scope="module")
def server(index: Path):
    with ServerThread(ServerConfig(index_dir=index, device="cpu", **LIMITS)) as running:
        yield running


@pytest.fixture()
def client(server: ServerThread):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def timed_ask(client: httpx.Client, document: str) -> tuple[httpx.Response, float]:
    began = time.perf_counter()
    response = client.post("/v1/ask", json={"question": SMALL_CORPUS_QUESTIONS[document], "max_new_tokens": 4})
    return response, time.perf_counter() - began


def many_segments_prompt(count: int, seed: int, words: int = 30) -> str:
    """`count` distinct segments of about 2 * `words` tokens, then the query."""
    rng = random.Random(seed)
    segments = [" ".join(rng.choice(WORDS) for _ in range(words)) + f" (note {seed}-{n})." for n in range(count)]
    return "<<PIC_SEP>>".join([*segments, "Which studio?"])


def cache_entries(client: httpx.Client) -> int:
    return int(client.get("/v1/cache/stats").json()["cache"]["entries"])


# --------------------------------------------------------------------------------------------- a huge document in steps
def test_a_huge_document_is_indexed_in_steps_while_asks_are_answered(tmp_path: Path, index: Path) -> None:
    """Before: the whole document was chunked and embedded as one step (minutes here); an ask sent meanwhile
    waited for all of it and got 504."""
    text = prose(2_000_000, seed=5)
    config = ServerConfig(index_dir=index, device="cpu", shutdown_grace_s=5.0, **LIMITS)
    server = ServerThread(config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            accepted = client.post("/v1/documents", json={"documents": [{"id": "huge.md", "text": text}]})
            assert accepted.status_code == 202, accepted.text
            job_url = accepted.json()["status_url"]
            deadline = time.monotonic() + 20
            while client.get(job_url).json()["status"] == "queued" and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # well inside the job: chunking and embedding 2 M characters takes minutes here
            for document in ("volcano.md", "chess.md"):
                response, elapsed = timed_ask(client, document)
                assert response.status_code == 200, response.text
                assert response.json()["sources"][0]["doc_id"] == document
                assert elapsed < PROMPT_ASK_S, f"an ask waited {elapsed:.1f} s behind the document job"
            job = client.get(job_url).json()
            assert job["status"] == "running", job  # the asks were answered in the middle of the job
    finally:
        began = time.monotonic()
        server.stop()
        stopped_in = time.monotonic() - began
    assert stopped_in < 15, f"shutdown waited {stopped_in:.1f} s for the job"  # stopped between two steps
    assert server.app.state.service.jobs.snapshot(accepted.json()["job_id"])["status"] == "cancelled"


def test_a_document_over_the_token_limit_is_413(client: httpx.Client) -> None:
    rng = random.Random(3)
    text = "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(400_000))  # 3 byte-level tokens a character
    response = client.post("/v1/documents", json={"documents": [{"id": "ok.md", "text": "Short text."},
                                                                {"id": "big.md", "text": text}]})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "documents[1].text"
    assert "1200000 tokens" in error["message"] and "at most 1000000" in error["message"], error["message"]
    assert client.get("/healthz").json()["documents"] == len(SMALL_CORPUS)  # nothing was queued


# -------------------------------------------------------------------------------------------- a deadline stops encoding
def test_a_completion_past_its_deadline_stops_encoding_segments(client: httpx.Client) -> None:
    """Before: 504 after the deadline, but the worker went on encoding every segment (~40 s here), so the next ask
    waited for it and the cache took in all of them."""
    segments = 1_999  # ~300k tokens: more than batched encoding gets through before the deadline, even on a quiet machine
    entries_before = cache_entries(client)
    began = time.perf_counter()
    response = client.post("/v1/completions", json={"prompt": many_segments_prompt(segments, seed=1, words=75),
                                                    "max_tokens": 4, "temperature": 0})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "timeout"
    assert time.perf_counter() - began < REQUEST_TIMEOUT_S + 3
    after, elapsed = timed_ask(client, "lavender.md")
    assert after.status_code == 200, after.text
    assert elapsed < PROMPT_ASK_S, f"the ask after the timed-out completion waited {elapsed:.1f} s"
    assert cache_entries(client) - entries_before < segments


def test_a_completion_whose_client_went_away_stops(server: ServerThread, client: httpx.Client) -> None:
    body = {"prompt": many_segments_prompt(1_500, seed=2), "max_tokens": 4, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)  # gives up, closes the connection
    time.sleep(0.6)  # the server notices within a poll and stops at the next segment
    after, elapsed = timed_ask(client, "bicycles.md")
    assert after.status_code == 200, after.text
    # had the completion run on to its deadline, this ask would have waited about 4 s more
    assert elapsed < 2.5, f"the ask after the abandoned completion waited {elapsed:.1f} s"


def test_too_many_segments_is_413(client: httpx.Client) -> None:
    prompt = "<<PIC_SEP>>".join(["a"] * 2_000 + ["Which?"])
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "2001 separated segments" in error["message"] and "at most 2000" in error["message"]
