"""Reuse without separators through LlamaIndex's own engines (real LlamaIndex, tiny random model).

An index ingested with the product's transformation, `Settings.llm = HypicLLM(...)`: `index.as_query_engine()`
(LlamaIndex's default template and compact synthesizer, one plain prompt) reuses >= 90% of its context tokens
from the second query on, and answers exactly as the same prompt sent with separators at the chunk boundaries.
HypicQueryEngine lays its prompt out differently (the product's prefix and question template, one line between
nodes, no metadata header), so its answer is compared where the prompts coincide: its own prompt text sent as one
plain string to the LLM is cut back into its request and gives its answer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode  # noqa: E402

from hypic_rag.integrations.llama_index import (  # noqa: E402
    HypicCacheTransformation,
    HypicEmbedding,
    HypicLLM,
    HypicQueryEngine,
)
from hypic_rag.integrations.llama_index.llm import MESSAGE_BOUNDARY  # noqa: E402
from hypic_rag.prompting.segments import DEFAULT_SEPARATOR  # noqa: E402
from kits.corpora import SMALL_CORPUS  # noqa: E402

logger = logging.getLogger(__name__)

SEAM = 8
DETAILS = {
    "glassblowing.md": "Her furnace burns at eleven hundred degrees and she blows cobalt vases for the harbour market "
                       "every spring, signing each one with a small engraved heron under the foot.",
    "astronomy.md": "The observatory sits on a basalt ridge above the town, and its dome was rebuilt in 2004 after a "
                    "winter storm tore away the copper shutters during the night.",
    "lavender.md": "Her farm has forty rows of lavender, eleven beehives painted in pale blue, and a stall by the "
                   "crossroads where visitors buy honey, soap and dried flowers on Saturdays.",
    "bicycles.md": "His workshop keeps a wall of steel frames from the nineteen sixties, and every autumn he rides a "
                   "restored racing bicycle in the coastal hill climb with his two nephews.",
}
QUESTIONS = ["Who founded the Amber Kiln glass studio?", "Who repairs old racing bicycles?",
             "Who grows lavender and sells honey?"]


class LLMEvents(BaseEventHandler):
    """Every LLM end event LlamaIndex dispatches (its instrumentation, as tracing tools read it)."""

    ended: list = []

    @classmethod
    def class_name(cls) -> str:
        return "LLMEvents"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, (LLMCompletionEndEvent, LLMChatEndEvent)):
            self.ended.append(event)


@pytest.fixture(scope="module")
def events():
    handler = LLMEvents(ended=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture(scope="module")
def llm(tiny_model: Path):
    hypic_llm = HypicLLM(model_path=str(tiny_model), seam_tokens=SEAM, device="cpu", max_new_tokens=6)
    previous = (Settings._llm, Settings._embed_model)
    Settings.llm, Settings.embed_model = hypic_llm, HypicEmbedding()
    yield hypic_llm
    Settings._llm, Settings._embed_model = previous
    hypic_llm.runtime.close()


@pytest.fixture(scope="module")
def index(llm: HypicLLM) -> VectorStoreIndex:
    documents = [Document(text=f"{SMALL_CORPUS[name]} {detail}", id_=name, metadata={"file_name": name})
                 for name, detail in DETAILS.items()]
    nodes = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=512, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
        HypicCacheTransformation(runtime=llm.runtime),  # encodes each node's entry and makes it a known chunk
        Settings.embed_model,
    ]).run(documents=documents)
    return VectorStoreIndex(nodes)


def node_texts(response) -> list[str]:
    return [item.node.get_content(metadata_mode=MetadataMode.NONE) for item in response.source_nodes]


def separated_by_hand(prompt: str, texts: list[str]) -> str:
    """`prompt` with a separator on both sides of each node's segment (its text and the newline after it),
    placed with plain string search: what a client would send to mark the chunks itself."""
    for text in texts:
        assert prompt.count(text + "\n") == 1
        prompt = prompt.replace(text + "\n", DEFAULT_SEPARATOR + text + "\n" + DEFAULT_SEPARATOR)
    return prompt


def test_default_query_engine_reuses_context_tokens_and_answers_as_the_separated_prompt(
    index: VectorStoreIndex, llm: HypicLLM, events: LLMEvents
) -> None:
    engine = index.as_query_engine()  # LlamaIndex's defaults throughout; Settings.llm generates
    usages, prompts, responses = [], [], []
    for question in QUESTIONS[:2]:
        events.ended.clear()
        responses.append(engine.query(question))
        (event,) = [e for e in events.ended if isinstance(e, LLMCompletionEndEvent)]  # compact: one LLM call
        prompts.append(event.prompt)
        usages.append(event.response.additional_kwargs)
    second, usage, prompt = responses[1], usages[1], prompts[1]
    texts = node_texts(second)
    assert len(texts) == 2 and all(text in prompt for text in texts)
    context_tokens = sum(len(llm.runtime.chunk_ids(text)) for text in texts)
    reused = usage["matched_cached_tokens"] / context_tokens
    logger.warning("as_query_engine, 2nd query: %d of %d context tokens reused (%.1f%%); prompt %d tokens, %d "
                   "cached, %d recomputed", usage["matched_cached_tokens"], context_tokens, 100 * reused,
                   usage["prompt_tokens"], usage["cached_tokens"], usage["recomputed_tokens"])
    assert usage["matched_segments"] == len(texts) and usage["matched_tokens"] == context_tokens
    assert reused >= 0.9
    assert usage["cached_tokens"] >= usage["matched_cached_tokens"]
    # the separated path: the same prompt with separators placed by hand at the node boundaries
    marked = separated_by_hand(prompt, texts)
    explicit = HypicLLM(runtime=llm.runtime, max_new_tokens=6, match_segments=False)
    assert explicit.segmented(marked, formatted=True).request == llm.segmented(prompt, formatted=True).request
    assert explicit.complete(marked, formatted=True).text == second.response
    # without matching the LLM recomputes LlamaIndex's prompt in full, as before
    plain = HypicLLM(runtime=llm.runtime, max_new_tokens=6, match_segments=False).complete(prompt, formatted=True)
    assert plain.additional_kwargs["matched_segments"] == 0 and plain.additional_kwargs["cached_tokens"] == 0


def test_hypic_query_engines_prompt_sent_as_plain_text_gives_its_request_and_answer(
    index: VectorStoreIndex, llm: HypicLLM
) -> None:
    question = QUESTIONS[2]
    answer = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm).query(question)
    texts, fmt = node_texts(answer), llm.runtime.prompt_format
    plain = fmt.prefix + "".join(fmt.chunk(text) for text in texts) + fmt.question(question)
    segmented = llm.segmented(plain, formatted=True)
    assert segmented.request == llm.runtime.rag_request(texts, question)  # prefix, one segment per node, question
    completion = llm.complete(plain, formatted=True, stop=[fmt.answer_stop])
    assert completion.text.strip() == answer.response
    usage = completion.additional_kwargs
    assert usage["matched_segments"] == len(texts) and usage["cache_misses"] == 0
    assert {key: usage[key] for key in answer.metadata["usage"]} == answer.metadata["usage"]


def test_chat_reuses_nodes_pasted_into_a_message_and_keeps_messages_as_segments(
    index: VectorStoreIndex, llm: HypicLLM
) -> None:
    from llama_index.core.llms import ChatMessage

    texts = [node.get_content(metadata_mode=MetadataMode.NONE) for node in index.docstore.docs.values()][:2]
    system = ChatMessage(role="system", content="Context:\n" + "\n".join(texts) + "\nAnswer in one word.")
    first = llm.chat([system, ChatMessage(role="user", content="Who keeps bees?")]).message.additional_kwargs
    second = llm.chat([system, ChatMessage(role="user", content="Who blows glass?")]).message.additional_kwargs
    assert first["matched_segments"] == second["matched_segments"] == 2
    assert second["cache_misses"] == 0  # the system message's pieces and the nodes, all reused
    assert second["matched_cached_tokens"] == sum(len(llm.runtime.chunk_ids(text)) - SEAM for text in texts)


def test_context_chat_engine_reuses_the_nodes_in_its_system_message(
    index: VectorStoreIndex, llm: HypicLLM, events: LLMEvents
) -> None:
    events.ended.clear()
    chat = index.as_chat_engine(chat_mode="context", similarity_top_k=2)
    response = chat.chat(QUESTIONS[0])
    (event,) = events.ended  # a non-chat LLM: LlamaIndex renders the messages with our messages_to_prompt
    assert MESSAGE_BOUNDARY in event.prompt
    usage = event.response.additional_kwargs
    assert usage["matched_segments"] == len(response.source_nodes) == 2
    assert usage["matched_cached_tokens"] == sum(
        len(llm.runtime.chunk_ids(text)) - SEAM for text in node_texts(response))
