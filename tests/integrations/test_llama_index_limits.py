"""Limits of `HypicLLM`: a prompt or chat over the model's context window (`metadata.context_window`), or with more
segments than `max_segments`, raises `PromptTooLongError` (one line naming the length and the limit) before any
model work. It ran: a 150,004-token prompt on a 4,096-token model 116 s (answer ''), a chat of 2,000 messages past
200 s, a stream of 60,000 words 151 s."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.llms import ChatMessage  # noqa: E402

from hypic_rag.errors import HypicError  # noqa: E402
from hypic_rag.integrations.llama_index import HypicLLM, PromptTooLongError  # noqa: E402


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> HypicLLM:
    return HypicLLM(model_path=str(tiny_model), device="cpu", max_new_tokens=4, seam_tokens=8)


def refused(call) -> str:  # noqa: ANN001 - a callable
    with pytest.raises(PromptTooLongError) as raised:
        call()
    message = str(raised.value)
    assert isinstance(raised.value, HypicError) and "\n" not in message
    return message


def test_prompts_over_the_context_window_are_refused_before_any_model_work(llm: HypicLLM) -> None:
    window = llm.metadata.context_window
    assert window == llm.runtime.context_window == 4096  # the tiny model's max_position_embeddings
    steps = llm.runtime.scheduler.steps
    huge = " ".join(["river"] * 150_000)
    message = refused(lambda: llm.complete(huge))
    assert f"{len(huge)} characters" in message and f"context window is {window} tokens" in message, message
    refused(lambda: llm.stream_complete(" ".join(["harbour"] * 60_000)))
    assert f"window is {window}" in refused(lambda: asyncio.run(llm.acomplete(huge)))
    history = [ChatMessage(role="user" if n % 2 == 0 else "assistant", content=f"message {n} about the bridge")
               for n in range(2_000)]
    assert f"window is {window}" in refused(lambda: llm.chat(history))
    refused(lambda: llm.stream_chat(history))
    assert llm.runtime.scheduler.steps == steps  # nothing reached the model

    short = [ChatMessage(role="user", content="hi")] * (llm.max_segments + 1)
    message = refused(lambda: llm.chat(short))
    assert f"{llm.max_segments + 1} segments" in message and f"at most {llm.max_segments}" in message, message


def test_the_new_tokens_count_against_the_window(llm: HypicLLM) -> None:
    prompt = "Where does the river meet the sea? " * 20
    tokens = llm.segmented(prompt).request.prompt_tokens
    room = llm.metadata.context_window - tokens
    message = refused(lambda: llm.complete(prompt, max_new_tokens=room + 1))
    assert f"has {tokens} tokens and asks for up to {room + 1} new ones" in message, message
    answer = llm.complete(prompt)  # fits: answered
    assert answer.raw["usage"]["prompt_tokens"] == tokens
