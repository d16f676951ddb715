"""Reuse without separators over HTTP: the official `openai` client against a real server on 127.0.0.1 whose
index holds `SMALL_CORPUS` (tiny model with a chat template). Chunk texts pasted into a completion prompt or a chat
message are found, cut out and served from their cached entries, with the answer the same prompt gets with
explicit separators; segments sent explicitly once are found later; a prompt holding no known text is answered
exactly as without matching; the server's off switch and the request's turn it off."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from hypic_rag.cli.main import build_parser
from hypic_rag.retrieval.corpus_index import DOCSTORE_FILE
from hypic_rag.retrieval.docstore import DocStore
from hypic_rag.prompting.segments import DEFAULT_SEPARATOR as SEP
from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, build_index, templated_checkpoint

SEAM = 8
NEW_DOCUMENT = ("Quill Varga paints ceramic tiles in a narrow studio in Szeged and fires them in a wood kiln "
                "behind the house every second Sunday.")


@pytest.fixture(scope="module")
def index(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("server_reuse")
    return build_index(root / "index", templated_checkpoint(root / "chat_model", tiny_model), SMALL_CORPUS)


@pytest.fixture(scope="module")
def chunks(index: Path) -> dict[str, str]:
    """The indexed chunk texts by document (one chunk each), read from the docstore before the server opens it."""
    store = DocStore(index / DOCSTORE_FILE)
    try:
        return {name: next(store.iter_chunk_texts(name)) for name in SMALL_CORPUS}
    finally:
        store.close()


@pytest.fixture(scope="module")
def client(index: Path, chunks: dict[str, str]):
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def complete(client: openai.OpenAI, prompt: str, **extra):
    return client.completions.create(model=model_of(client), prompt=prompt, max_tokens=5, temperature=0,
                                     extra_body=extra or None)


def counts(response) -> dict:
    """The response's usage: OpenAI's fields and hypic-rag's counters (`hypic_rag.pipeline.vocabulary`)."""
    return response.usage.model_dump()


def segment_tokens(client: openai.OpenAI, text: str) -> int:
    """Tokens of `text` formatted as a chunk segment (the prompt of a completion asking for nothing else)."""
    response = complete(client, text + "\n", match_segments=False)
    return response.usage.prompt_tokens


def test_completion_reuses_pasted_chunks_and_answers_as_with_separators(client, chunks) -> None:
    chess, bikes = chunks["chess.md"], chunks["bicycles.md"]
    pasted = f"Documents:\n{chess}\n{bikes}\nQuestion: Who is the champion?\nAnswer:"
    first, second = complete(client, pasted), complete(client, pasted)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    details = counts(second)
    assert details["matched_segments"] == 2 and details["segments"] == 4 and details["cache_misses"] == 0
    context = segment_tokens(client, chess) + segment_tokens(client, bikes)
    assert details["matched_tokens"] == context and details["matched_cached_tokens"] == context - 2 * SEAM
    separated = complete(client, f"Documents:\n{SEP}{chess}\n{SEP}{bikes}\n{SEP}Question: Who is the champion?"
                                 "\nAnswer:")
    assert separated.choices[0].text == second.choices[0].text
    assert separated.usage.prompt_tokens == second.usage.prompt_tokens
    assert separated.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    streamed = list(client.completions.create(model=model_of(client), prompt=pasted, max_tokens=5, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == second.choices[0].text
    assert streamed[-1].usage.model_dump()["matched_segments"] == 2


def test_chat_reuses_chunks_pasted_into_a_message_as_content_parts_would(client, chunks) -> None:
    lavender, volcano = chunks["lavender.md"], chunks["volcano.md"]
    question = "Who sells honey?"
    pasted = [{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": f"{lavender}\n{volcano}\n{question}"}]
    parts = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": text} for text in (lavender, volcano, question)]}]
    first = client.chat.completions.create(messages=pasted, model=model_of(client), max_tokens=5, temperature=0)
    second = client.chat.completions.create(messages=pasted, model=model_of(client), max_tokens=5, temperature=0)
    by_parts = client.chat.completions.create(messages=parts, model=model_of(client), max_tokens=5, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0 and counts(second)["matched_segments"] == 2
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].message.content == by_parts.choices[0].message.content  # the same segments
    assert second.usage.prompt_tokens == by_parts.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == by_parts.usage.prompt_tokens_details.cached_tokens


def test_a_document_sent_as_a_part_is_found_later_without_separators(client) -> None:
    parts = [{"type": "text", "text": NEW_DOCUMENT}, {"type": "text", "text": "Who paints tiles?"}]
    client.chat.completions.create(messages=[{"role": "user", "content": parts}], model=model_of(client), max_tokens=2)
    later = complete(client, f"Notes: {NEW_DOCUMENT}\nWhere does she fire them?")
    assert counts(later)["matched_segments"] == 1 and counts(later)["matched_cached_tokens"] > 0
    # the only new text, "Notes: ", is shorter than the seam: recomputed whole, no entry read or stored for it
    assert counts(later)["cache_misses"] == 0


def test_a_prompt_without_known_text_is_answered_as_without_matching(client, chunks) -> None:
    partial = chunks["astronomy.md"][: len(chunks["astronomy.md"]) // 2]
    prompt = f"Some notes: {partial}\nWhich comet was found?"
    matched, unmatched = complete(client, prompt), complete(client, prompt, match_segments=False)
    assert counts(matched)["matched_segments"] == 0 and counts(matched)["segments"] == 1
    assert matched.choices[0].text == unmatched.choices[0].text
    assert matched.usage.model_dump() == unmatched.usage.model_dump()


def test_a_request_can_turn_matching_off(client, chunks) -> None:
    prompt = f"Documents:\n{chunks['chess.md']}\nWho won?"
    off = complete(client, prompt, match_segments=False)
    assert counts(off)["matched_segments"] == 0 and off.usage.prompt_tokens_details.cached_tokens == 0


def test_the_server_can_be_started_without_matching(tiny_model: Path, tmp_path: Path, chunks) -> None:
    assert build_parser().parse_args(["serve", "--index", "x", "--no-segment-matching"]).match_segments is False
    assert build_parser().parse_args(["serve", "--index", "x"]).match_segments is True
    index = build_index(tmp_path / "index", templated_checkpoint(tmp_path / "model", tiny_model),
                        {"chess.md": SMALL_CORPUS["chess.md"]})
    with ServerThread(ServerConfig(index_dir=index, device="cpu", match_segments=False)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = complete(client, f"Documents:\n{chunks['chess.md']}\nWho won?", match_segments=True)
    assert counts(response)["matched_segments"] == 0 and response.usage.prompt_tokens_details.cached_tokens == 0
