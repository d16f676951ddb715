"""OpenAI compatibility, driven with the official `openai` client against a real server on 127.0.0.1.

Chat completions (streaming and not) over a tiny model whose tokenizer has a chat template, documents cached as
segments; completions with vLLM's parameters (n, logprobs, echo, penalties, logit_bias, top_k, seed, token-id and
batched prompts); 404 for an unknown model, 400 for invalid fields; /docs without a CDN.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from hypic_rag.prompting.chat import ChatMessage, chat_prompt
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, tokenize_segment
from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
from hypic_rag.server.runner import ServerThread
from kits.corpora import SMALL_CORPUS, build_index

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DOCS = ["Orla Brennan keeps mountain goats on a farm above Kilcar.",
        "Pavel Horak restores church organs in the town of Olomouc."]


def templated_checkpoint(directory: Path, base: Path) -> Path:
    """A copy of the tiny model whose tokenizer carries `CHAT_TEMPLATE`."""
    import shutil

    from transformers import AutoTokenizer

    if not (directory / "config.json").is_file():
        shutil.copytree(base, directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("server_openai")
    model = templated_checkpoint(root / "chat_model", tiny_model)
    index = build_index(root / "index", model, dict(list(SMALL_CORPUS.items())[:2]))
    with ServerThread(ServerConfig(index_dir=index, device="cpu")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_messages(question: str = "Who keeps goats?") -> list[dict]:
    parts = [{"type": "text", "text": doc} for doc in DOCS] + [{"type": "text", "text": question}]
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": parts}]


# ------------------------------------------------------------------------------------------------ rendering
def test_chat_template_rendering_cuts_documents_out_as_segments(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(templated_checkpoint(tmp_path / "m", tiny_model))
    messages = [ChatMessage("system", ("Be brief.",)), ChatMessage("user", (*DOCS, "Who keeps goats?"))]
    prompt = chat_prompt(tokenizer, messages, DEFAULT_PROMPT_FORMAT)
    assert prompt.templated and prompt.documents == 2
    header = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    expected = [tokenize_segment(tokenizer, text) for text in (header, DOCS[0] + "\n", DOCS[1] + "\n")]
    assert prompt.request.chunk_ids == expected
    tail = "Who keeps goats?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.request.question_ids == tokenize_segment(tokenizer, tail)
    whole = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "".join(d + "\n" for d in DOCS) +
                                            "Who keeps goats?"}], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt.request.all_ids()) == whole  # the same text, cut at the documents


def test_without_a_chat_template_the_products_prompt_format_is_used(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert not tokenizer.chat_template
    content = DEFAULT_SEPARATOR.join([*DOCS, "Who keeps goats?"])
    messages = [ChatMessage("system", ("Be brief.",)), ChatMessage.of("user", content, DEFAULT_SEPARATOR)]
    prompt = chat_prompt(tokenizer, messages, DEFAULT_PROMPT_FORMAT)
    fmt = DEFAULT_PROMPT_FORMAT
    assert not prompt.templated and prompt.stop_strings == (fmt.answer_stop,)
    assert prompt.request.prefix_ids == tokenize_segment(tokenizer, fmt.prefix)
    assert prompt.request.chunk_ids == [tokenize_segment(tokenizer, fmt.chunk(doc)) for doc in DOCS]
    assert prompt.request.question_ids == tokenize_segment(
        tokenizer, "System: Be brief.\n" + fmt.question("Who keeps goats?"))


# ------------------------------------------------------------------------------------------------ chat
def test_chat_reuses_documents_sent_as_content_parts(client: openai.OpenAI, model_id: str) -> None:
    messages = chat_messages("Who restores organs?")
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=4, temperature=0)
    assert first.object == "chat.completion" and first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    assert first.usage.model_extra["encoded_tokens"] > 0  # our extension, as on /v1/completions
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens and cached > 0
    assert second.usage.model_extra["cache_misses"] == 0


def test_chat_reuses_documents_in_separated_text(client: openai.OpenAI, model_id: str) -> None:
    content = DEFAULT_SEPARATOR.join(["Quill Varga paints ceramic tiles in Szeged.", "Who paints tiles?"])
    messages = [{"role": "user", "content": content}]
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=3, temperature=0)
    second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=3, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


def test_chat_stream_is_chunked_as_openai_and_adds_up(client: openai.OpenAI, model_id: str) -> None:
    messages = chat_messages()
    whole = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n_logprobs_and_seed(client: openai.OpenAI, model_id: str) -> None:
    options = dict(model=model_id, messages=chat_messages(), max_tokens=5, temperature=1.5, seed=7, n=3)
    first = client.chat.completions.create(**options, logprobs=True, top_logprobs=2)
    again = client.chat.completions.create(**options, logprobs=True, top_logprobs=2)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in first.choices}) > 1  # seed + index: different samples
    content = first.choices[0].logprobs.content
    assert content and all(len(item.top_logprobs) == 2 and item.logprob <= 0 for item in content)
    assert first.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in first.choices)  # one entry per generated token


# ------------------------------------------------------------------------------------------------ completions
def test_completions_stream_and_not_through_the_client(client: openai.OpenAI, model_id: str) -> None:
    prompt = f"{DOCS[0]}{DEFAULT_SEPARATOR}Who keeps goats?"
    whole = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    streamed = list(client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    again = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > whole.usage.prompt_tokens_details.cached_tokens


def test_completions_echo_logprobs_batches_and_token_ids(client: openai.OpenAI, model_id: str,
                                                         tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    plain = client.completions.create(model=model_id, prompt="Who keeps goats?", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model_id, prompt="Who keeps goats?", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Who keeps goats?" + plain.choices[0].text
    with_logprobs = client.completions.create(model=model_id, prompt="Who keeps goats?", max_tokens=4,
                                              temperature=0, logprobs=3)
    logprobs = with_logprobs.choices[0].logprobs
    # (byte tokens decode alike, so top_logprobs' keys may collide: at most 3 + the chosen one)
    assert "".join(logprobs.tokens) == plain.choices[0].text and 1 <= len(logprobs.top_logprobs[0]) <= 4
    assert logprobs.token_logprobs[0] == pytest.approx(max(logprobs.top_logprobs[0].values()))  # greedy: the best
    token_ids = tokenizer("Who keeps goats?", add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(model=model_id, prompt=token_ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == "Who keeps goats?" + plain.choices[0].text  # the same prompt, decoded
    id_batch = client.completions.create(model=model_id, prompt=[token_ids, token_ids], max_tokens=4, temperature=0)
    assert [c.text for c in id_batch.choices] == [plain.choices[0].text] * 2
    batch = client.completions.create(model=model_id, prompt=["Who keeps goats?", "Who keeps goats?", "Who?"], n=2,
                                      max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices[:4]] == [plain.choices[0].text] * 4
    assert batch.usage.prompt_tokens == 2 * plain.usage.prompt_tokens + 2  # "Who?" is 2 tokens, counted once


def test_logit_bias_penalties_and_top_k_reach_the_sampler(client: openai.OpenAI, model_id: str,
                                                          tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    forced = tokenizer("goats", add_special_tokens=False)["input_ids"][0]
    options = dict(model=model_id, prompt="Who keeps goats?", max_tokens=4, temperature=0, logprobs=0)
    biased = client.completions.create(**options, logit_bias={str(forced): 100})
    assert biased.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 4
    penalised = client.completions.create(**options, logit_bias={str(forced): 100}, presence_penalty=2.0,
                                          frequency_penalty=2.0)
    assert penalised.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 4  # 100 - 4 still wins
    mild = client.completions.create(**options, logit_bias={str(forced): 3}, frequency_penalty=2.0)
    assert mild.choices[0].logprobs.tokens.count(tokenizer.decode([forced])) < 4  # the penalty lets others in
    greedy = client.completions.create(**{**options, "logprobs": None})
    top1 = {client.completions.create(**{**options, "logprobs": None, "temperature": 2.0, "seed": seed},
                                      extra_body={"top_k": 1}).choices[0].text for seed in range(3)}
    assert top1 == {greedy.choices[0].text}  # top_k=1 samples the argmax whatever the temperature


# ------------------------------------------------------------------------------------------------ errors, models
def test_unknown_model_is_404_and_models_by_id(client: openai.OpenAI, model_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=chat_messages(), max_tokens=2)
    assert raised.value.body["param"] == "model"
    # OpenAI's own body for it (what its clients and vLLM's users check)
    assert (raised.value.body["type"], raised.value.code) == ("invalid_request_error", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="Hi?", max_tokens=2)
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize("options", [{"temperature": 5}, {"n": 0}, {"presence_penalty": 3},
                                     {"logit_bias": {"x": 1}}, {"extra_body": {"top_k": -2}},
                                     {"logit_bias": {"999999": 1}}, {"max_tokens": 100000}])
def test_invalid_parameters_are_400(client: openai.OpenAI, model_id: str, options: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="Hi?", **{"max_tokens": 2, **options})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=chat_messages(), **{"max_tokens": 2, **options})


def test_docs_page_loads_nothing_from_outside(server: ServerThread) -> None:
    page = httpx.get(f"{server.url}/docs")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text
    assert "http://" not in page.text and "https://" not in page.text and "<script" not in page.text
    assert "/v1/chat/completions" in httpx.get(f"{server.url}/openapi.json").json()["paths"]
