"""Chat completions on a model without a chat template (the bundled default model's case), through the official
`openai` client against a real server on 127.0.0.1: bad messages are 400s, never 500s."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from hypic_rag.server import ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, build_index


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server_chat_plain")
    index = build_index(root / "index", tiny_model, dict(list(SMALL_CORPUS.items())[:2]))
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("content", ["", "   ", [], [{"type": "text", "text": "Some document text here."},
                                                    {"type": "text", "text": ""}], "a document<<PIC_SEP>>"])
def test_an_empty_question_is_a_400_not_a_500(client: openai.OpenAI, content: object) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2,
                                       messages=[{"role": "user", "content": content}])
    assert raised.value.body["param"] == "messages"


def test_null_content_is_a_400_and_streams_a_400_error(server: ServerThread) -> None:
    body = {"messages": [{"role": "user", "content": None}], "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    flat = streamed.text.replace(" ", "")
    assert '"type":"invalid_request_error"' in flat and '"code":"invalid_value"' in flat and "internal" not in flat


NULLABLE = ["max_tokens", "temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "echo",
            "logprobs", "mode", "seed", "stop"]


@pytest.mark.parametrize("field", NULLABLE)
def test_null_means_the_default_as_openai_and_vllm_take_it(server: ServerThread, field: str) -> None:
    """OpenAI's spec makes these parameters nullable (`"max_tokens": null` is the default); clients send nulls."""
    route, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Who keeps goats?"}]})
                   if field == "logprobs" else ("/v1/completions", {"prompt": "Who keeps goats?"}))
    limit = {} if field == "max_tokens" else {"max_tokens": 2}
    plain = httpx.post(f"{server.url}{route}", json={**body, "temperature": 0, "max_tokens": 16, **limit}, timeout=60)
    nulled = httpx.post(f"{server.url}{route}",
                        json={**body, "temperature": 0, "max_tokens": 16, **limit, field: None}, timeout=60)
    assert nulled.status_code == 200, nulled.text
    if field != "temperature":  # null temperature is OpenAI's default 1 (sampled), the others must not change a thing
        assert nulled.json()["choices"] == plain.json()["choices"]
