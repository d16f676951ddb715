"""LlamaIndex's own machinery around hypic-rag, with real LlamaIndex components and a real segment cache:
node postprocessors, response modes, options checked by name, prompts (get/update), instrumentation events,
TokenCountingHandler, async queries that leave the event loop free (streaming included), the segment synthesizer
inside LlamaIndex's query engines, and the context chat engines.

A tiny random model generates (answers are gibberish); what is checked is how prompts are laid out, what the cache
reuses, which events LlamaIndex sees and that async and sync paths give the same answers.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse  # noqa: E402
from llama_index.core.bridge.pydantic import Field  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.llms import ChatMessage, MockLLM  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.postprocessor import SimilarityPostprocessor  # noqa: E402
from llama_index.core.postprocessor.types import BaseNodePostprocessor  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle  # noqa: E402

from hypic_rag.integrations.llama_index import (  # noqa: E402
    HypicCacheTransformation,
    HypicCondensePlusContextChatEngine,
    HypicContextChatEngine,
    HypicEmbedding,
    HypicLLM,
    HypicQueryEngine,
    HypicSynthesizer,
)
from hypic_rag.runtime.sampling import SamplingParams  # noqa: E402
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS  # noqa: E402

SEAM = 8
TOP_K = 3


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    cache_dir = tmp_path_factory.mktemp("llama_native") / "segment_cache"
    hypic_llm = HypicLLM(model_path=str(tiny_model), cache_dir=str(cache_dir), seam_tokens=SEAM, device="cpu",
                         max_new_tokens=6)
    previous = (Settings._llm, Settings._embed_model, Settings._callback_manager)
    Settings.llm = hypic_llm
    Settings.embed_model = HypicEmbedding()
    yield hypic_llm
    Settings._llm, Settings._embed_model, Settings._callback_manager = previous
    hypic_llm.runtime.close()


def documents() -> list[Document]:
    return [Document(text=text, id_=name, metadata={"file_name": name}) for name, text in SMALL_CORPUS.items()]


@pytest.fixture(scope="module")
def nodes(llm: HypicLLM):
    return IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=96, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
        HypicCacheTransformation(runtime=llm.runtime),
        Settings.embed_model,
    ]).run(documents=documents())


@pytest.fixture(scope="module")
def index(nodes) -> VectorStoreIndex:
    return VectorStoreIndex(nodes)


class Recorder(BaseEventHandler):
    """Every instrumentation event LlamaIndex dispatches."""

    events: list[Any] = Field(default_factory=list)

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.events.append(event)

    def named(self, name: str) -> list[Any]:
        return [event for event in self.events if event.class_name() == name]


@pytest.fixture
def recorder():
    root = get_dispatcher()
    handler = Recorder()
    root.add_event_handler(handler)
    yield handler
    root.event_handlers.remove(handler)


def node_text(item: NodeWithScore) -> str:
    return item.node.get_content(metadata_mode=MetadataMode.NONE)


def layout_tokens(llm: HypicLLM, head: str, texts: list[str], question: str) -> int:
    runtime = llm.runtime
    return len(runtime.tokenize(head)) + sum(len(runtime.chunk_ids(text)) for text in texts) + len(
        runtime.tokenize(question))


# ------------------------------------------------------------------------------------------------ postprocessors
class RequiredWord(BaseNodePostprocessor):
    """Keeps the nodes whose text holds `word` (a keyword filter without spaCy)."""

    word: str

    def _postprocess_nodes(self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
                           ) -> list[NodeWithScore]:
        return [item for item in nodes if self.word in node_text(item)]


def test_node_postprocessors_change_the_sources_and_the_prompt(index: VectorStoreIndex, llm: HypicLLM) -> None:
    question = SMALL_CORPUS_QUESTIONS["bicycles.md"]
    retriever = index.as_retriever(similarity_top_k=TOP_K)
    plain = HypicQueryEngine(retriever=retriever, llm=llm).query(question)
    assert len(plain.source_nodes) == TOP_K
    scores = [item.score for item in plain.source_nodes]
    cutoff = (scores[0] + scores[1]) / 2
    kept = HypicQueryEngine(retriever=retriever, llm=llm,
                            node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=cutoff)]).query(question)
    assert [item.node.node_id for item in kept.source_nodes] == [plain.source_nodes[0].node.node_id]
    runtime = llm.runtime
    assert kept.metadata["usage"]["prompt_tokens"] == layout_tokens(
        llm, runtime.prompt_format.prefix, [node_text(kept.source_nodes[0])], runtime.prompt_format.question(question))
    assert kept.metadata["usage"]["cache_hits"] == 2  # the prefix and the one node left

    word = "volcano"
    everything = index.as_retriever(similarity_top_k=len(SMALL_CORPUS))
    having = {item.node.node_id for item in everything.retrieve(question) if word in node_text(item)}
    filtered = HypicQueryEngine(retriever=everything, llm=llm, node_postprocessors=[RequiredWord(word=word)]
                                ).query(question)
    assert 0 < len(having) < len(SMALL_CORPUS)
    assert {item.node.node_id for item in filtered.source_nodes} == having
    assert HypicQueryEngine(retriever=retriever, llm=llm, node_postprocessors=[RequiredWord(word="zzzz")]
                            ).query(question).response == "Empty Response"  # LlamaIndex's answer without nodes


# ------------------------------------------------------------------------------------------------ options
def test_unknown_options_and_modes_are_refused_by_name(index: VectorStoreIndex, llm: HypicLLM) -> None:
    retriever = index.as_retriever(similarity_top_k=TOP_K)
    with pytest.raises(TypeError, match=r"'node_postprocesors' \(did you mean 'node_postprocessors'\?\)"):
        HypicQueryEngine(retriever=retriever, llm=llm, node_postprocesors=[])
    with pytest.raises(TypeError, match=r"'similarity_top_k'.*belong to the retriever"):
        HypicQueryEngine(retriever=retriever, llm=llm, similarity_top_k=2)
    with pytest.raises(TypeError, match=r"'respone_mode' \(did you mean 'response_mode'\?\)"):
        HypicSynthesizer(llm=llm, respone_mode="compact")
    for mode in ("refine", "tree_summarize", "compact_accumulate", "bogus"):
        with pytest.raises(ValueError, match=r"supported: compact, simple_summarize, accumulate, no_text"):
            HypicQueryEngine(retriever=retriever, llm=llm, response_mode=mode)
    with pytest.raises(ValueError, match="cannot stream"):
        HypicSynthesizer(llm=llm, response_mode="accumulate", streaming=True)
    with pytest.raises(ValueError, match="unknown mode"):
        HypicSynthesizer(llm=llm, mode="fast")
    with pytest.raises(ValueError, match="max_new_tokens"):
        HypicSynthesizer(llm=llm, max_new_tokens=0)
    with pytest.raises(TypeError, match="must be a HypicLLM"):
        HypicSynthesizer(llm=MockLLM())
    with pytest.raises(TypeError, match="retriever must be"):
        HypicQueryEngine(retriever=None, llm=llm)
    synthesizer = HypicSynthesizer(llm=llm)
    nodes = retriever.retrieve("bees")
    with pytest.raises(TypeError, match="'temprature'"):
        synthesizer.synthesize("Who keeps bees?", nodes, temprature=0.5)
    with pytest.raises(TypeError, match=r"'similarity_top_k'"):
        HypicContextChatEngine.from_defaults(retriever=retriever, llm=llm, similarity_top_k=2)
    with pytest.raises(ValueError, match="unknown mode"):
        HypicCondensePlusContextChatEngine.from_defaults(retriever=retriever, llm=llm, mode="fast")


# ------------------------------------------------------------------------------------------------ response modes
def test_response_modes(index: VectorStoreIndex, llm: HypicLLM) -> None:
    question = SMALL_CORPUS_QUESTIONS["chess.md"]
    retriever = index.as_retriever(similarity_top_k=TOP_K)
    compact = HypicQueryEngine(retriever=retriever, llm=llm).query(question)
    simple = HypicQueryEngine(retriever=retriever, llm=llm, response_mode="simple_summarize").query(question)
    assert simple.response == compact.response and simple.metadata["usage"] == compact.metadata["usage"]
    assert compact.metadata["calls"] == 1 and compact.metadata["response_mode"] == "compact"

    accumulated = HypicQueryEngine(retriever=retriever, llm=llm, response_mode="accumulate").query(question)
    assert accumulated.metadata["calls"] == TOP_K
    synthesizer = HypicSynthesizer(llm=llm)
    one_by_one = [synthesizer.synthesize(question, [item]) for item in accumulated.source_nodes]
    expected = "\n---------------------\n".join(
        f"Response {number + 1}: {response.response or 'Empty Response'}" for number, response in enumerate(one_by_one))
    assert accumulated.response == expected
    usage = accumulated.metadata["usage"]
    assert usage["prompt_tokens"] == sum(response.metadata["usage"]["prompt_tokens"] for response in one_by_one)
    assert usage["cache_hits"] == 2 * TOP_K and usage["cache_misses"] == 0  # prefix + its node, per call

    nothing = HypicQueryEngine(retriever=retriever, llm=llm, response_mode="no_text").query(question)
    assert nothing.response == "" and nothing.metadata["calls"] == 0 and nothing.metadata["usage"]["prompt_tokens"] == 0
    assert [n.node.node_id for n in nothing.source_nodes] == [n.node.node_id for n in compact.source_nodes]


def test_answers_stop_at_the_end_of_the_answer(index: VectorStoreIndex, llm: HypicLLM) -> None:
    """Greedy generation without a stop runs past a newline for some questions; with the answer stop the
    synthesizer's answer is exactly that text cut at the newline."""
    runtime, checked = llm.runtime, 0
    synthesizer = HypicSynthesizer(llm=llm, max_new_tokens=24)
    retriever = index.as_retriever(similarity_top_k=1)
    for question in SMALL_CORPUS_QUESTIONS.values():
        nodes = retriever.retrieve(question)
        unstopped = runtime.generate(runtime.rag_request([node_text(nodes[0])], question), "hypic",
                                     SamplingParams(max_new_tokens=24)).text
        if "\n" not in unstopped:
            continue
        response = synthesizer.synthesize(question, nodes)
        assert response.response == unstopped.split("\n")[0].strip()
        assert response.metadata["finish_reason"] == "stop"
        checked += 1
    assert checked >= 1, "no question made the tiny model write a newline: the stop is untested"


# ------------------------------------------------------------------------------------------------ prompts
def test_update_prompts_changes_the_prompt_sent(index: VectorStoreIndex, llm: HypicLLM, recorder: Recorder) -> None:
    question = SMALL_CORPUS_QUESTIONS["lavender.md"]
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm)
    prompts = engine.get_prompts()
    assert list(prompts) == ["response_synthesizer:text_qa_template"]
    default = prompts["response_synthesizer:text_qa_template"]
    runtime = llm.runtime
    assert default.format(context_str="<nodes>", query_str="Q?") == (
        runtime.prompt_format.prefix + "<nodes>" + runtime.prompt_format.question("Q?"))
    before = engine.query(question)

    engine.update_prompts({"response_synthesizer:text_qa_template": PromptTemplate(
        "Notes to answer from:\n{context_str}Q: {query_str}\nA:")})
    assert engine.get_prompts()["response_synthesizer:text_qa_template"].template.startswith("Notes to answer from")
    after = engine.query(question)
    prompt = recorder.named("LLMCompletionStartEvent")[-1].prompt
    texts = [node_text(item) for item in after.source_nodes]
    assert prompt == "Notes to answer from:\n" + "".join(runtime.prompt_format.chunk(t) for t in texts) + (
        f"Q: {question}\nA:")
    usage = after.metadata["usage"]
    assert usage["prompt_tokens"] == layout_tokens(llm, "Notes to answer from:\n", texts, f"Q: {question}\nA:")
    assert usage["prompt_tokens"] != before.metadata["usage"]["prompt_tokens"]
    assert usage["cache_hits"] == 2 and usage["cache_misses"] == 1  # the nodes reused; the new prefix encoded

    with pytest.raises(ValueError, match=r"\{context_str\} exactly once"):
        engine.update_prompts({"response_synthesizer:text_qa_template": PromptTemplate("Q: {query_str}\nA:")})
    with pytest.raises(ValueError, match=r"must not put \{query_str\} before"):
        engine.update_prompts({"response_synthesizer:text_qa_template": PromptTemplate(
            "Q: {query_str}\n{context_str}A:")})
    with pytest.raises(ValueError, match="no prompt 'refine_template'"):
        engine.update_prompts({"response_synthesizer:refine_template": PromptTemplate("{context_str}{query_str}")})
    with pytest.raises(ValueError, match="response_synthesizer:text_qa_template"):
        engine.update_prompts({"text_qa_template": PromptTemplate("{context_str}{query_str}")})


# ------------------------------------------------------------------------------------------------ events
def test_instrumentation_sees_the_query_and_every_llm_call(index: VectorStoreIndex, llm: HypicLLM,
                                                           recorder: Recorder) -> None:
    question = SMALL_CORPUS_QUESTIONS["astronomy.md"]
    response = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm).query(question)
    names = [event.class_name() for event in recorder.events]
    expected = ["QueryStartEvent", "RetrievalStartEvent", "RetrievalEndEvent", "SynthesizeStartEvent",
                "LLMCompletionStartEvent", "LLMCompletionEndEvent", "SynthesizeEndEvent", "QueryEndEvent"]
    positions = [names.index(name) for name in expected]
    assert positions == sorted(positions), names
    start, end = recorder.named("LLMCompletionStartEvent")[0], recorder.named("LLMCompletionEndEvent")[0]
    assert all(node_text(item) in start.prompt for item in response.source_nodes)
    assert start.prompt.endswith(llm.runtime.prompt_format.question(question))
    assert start.model_dict["class_name"] == "HypicLLM" and start.span_id and end.span_id == start.span_id
    assert end.response.text == response.response
    assert end.response.raw["usage"] == response.metadata["usage"]
    assert end.response.raw["usage"]["prompt_tokens"] > 0

    recorder.events.clear()
    streamed = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm, streaming=True
                                ).query(question)
    deltas = list(streamed.response_gen)
    progress = recorder.named("LLMCompletionInProgressEvent")
    assert [event.response.delta for event in progress] == deltas
    assert recorder.named("LLMCompletionEndEvent")[0].response.raw["usage"] == response.metadata["usage"]


def test_token_counting_handler_counts_what_usage_reports(index: VectorStoreIndex, llm: HypicLLM) -> None:
    question = SMALL_CORPUS_QUESTIONS["bicycles.md"]
    counter = TokenCountingHandler(tokenizer=llm.runtime.tokenize)  # LlamaIndex's default tokenizer is tiktoken
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm,
                              callback_manager=CallbackManager([counter]))
    usage = engine.query(question).metadata["usage"]
    assert len(counter.llm_token_counts) == 1
    assert counter.prompt_llm_token_count == usage["prompt_tokens"] > 0
    assert counter.completion_llm_token_count == usage["completion_tokens"]

    counter.reset_counts()  # the LLM's own calls: chat is counted once (not once more for the completion inside)
    llm.callback_manager = CallbackManager([counter])
    try:
        reply = llm.chat([ChatMessage(role="system", content="Answer briefly."),
                          ChatMessage(role="user", content=question)])
        streamed = list(llm.stream_complete("Bees live in hives.<<PIC_SEP>>Where do bees live?"))
    finally:
        llm.callback_manager = CallbackManager([])
    assert len(counter.llm_token_counts) == 2
    chat_count, stream_count = counter.llm_token_counts
    assert chat_count.prompt_token_count == reply.message.additional_kwargs["prompt_tokens"]
    assert chat_count.completion_token_count == reply.message.additional_kwargs["completion_tokens"]
    assert stream_count.prompt_token_count == streamed[-1].raw["usage"]["prompt_tokens"] > 0
    assert streamed[-1].delta == "" and "".join(item.delta for item in streamed) == streamed[-1].text


# ------------------------------------------------------------------------------------------------ async
def test_aquery_leaves_the_event_loop_free(index: VectorStoreIndex, llm: HypicLLM, recorder: Recorder) -> None:
    """Two aqueries wait for the model (its lock held by another thread) while a heartbeat task keeps ticking;
    a blocking aquery would stall the loop until the holder gives up and finish one query at a time."""
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm)
    questions = [SMALL_CORPUS_QUESTIONS["volcano.md"], SMALL_CORPUS_QUESTIONS["chess.md"]]
    expected = [engine.query(question).response for question in questions]
    runtime = llm.runtime

    async def scenario() -> dict[str, Any]:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.002)

        beat = asyncio.create_task(heartbeat())
        held, release, outcome = threading.Event(), threading.Event(), {}

        def hold() -> None:
            with runtime.lock:
                held.set()
                outcome["released_in_time"] = release.wait(timeout=30)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        started = len(recorder.named("LLMCompletionStartEvent"))
        queries = [asyncio.create_task(engine.aquery(question)) for question in questions]
        for _ in range(4000):  # up to 20 s on a loaded machine
            if len(recorder.named("LLMCompletionStartEvent")) - started == 2:
                break
            await asyncio.sleep(0.005)
        at = ticks
        await asyncio.sleep(0.2)
        outcome.update(ticked=ticks - at, waiting=[not query.done() for query in queries],
                       started=len(recorder.named("LLMCompletionStartEvent")) - started)
        release.set()
        outcome["responses"] = await asyncio.gather(*queries)
        beat.cancel()
        holder.join()
        return outcome

    outcome = asyncio.run(scenario())
    assert outcome["released_in_time"], "the event loop stalled while the model was busy"
    assert outcome["started"] == 2 and outcome["waiting"] == [True, True]  # both in flight at once
    assert outcome["ticked"] >= 3
    assert [response.response for response in outcome["responses"]] == expected


def test_streaming_aquery_yields_the_answer_asynchronously(index: VectorStoreIndex, llm: HypicLLM) -> None:
    retriever = index.as_retriever(similarity_top_k=2)
    questions = [SMALL_CORPUS_QUESTIONS[name] for name in ("bicycles.md", "lavender.md", "astronomy.md")]
    plain = [HypicQueryEngine(retriever=retriever, llm=llm).query(question) for question in questions]
    engine = HypicQueryEngine(retriever=retriever, llm=llm, streaming=True)

    async def stream_all() -> list[tuple[AsyncStreamingResponse, list[str]]]:
        out = []
        for question in questions:
            response = await engine.aquery(question)
            assert isinstance(response, AsyncStreamingResponse)
            out.append((response, [delta async for delta in response.async_response_gen()]))
        # stopping early releases the model (the stream's thread closes it) for the next query
        response = await engine.aquery(questions[0])
        await response.response_gen.aclose()
        return out

    results = asyncio.run(stream_all())
    for (response, deltas), reference in zip(results, plain, strict=True):
        assert "".join(deltas) == reference.response and all(deltas)
        assert response.metadata["usage"] == reference.metadata["usage"]
        assert response.metadata["timings"]["retrieval"] >= 0 and "time_to_first_token" in response.metadata["timings"]
    assert llm.runtime.lock.acquire(timeout=10)
    llm.runtime.lock.release()


def test_llm_async_methods_match_the_sync_ones(llm: HypicLLM) -> None:
    prompt = "Orla keeps goats.<<PIC_SEP>>Who keeps goats?"
    messages = [ChatMessage(role="system", content="One word."), ChatMessage(role="user", content="Who keeps goats?")]
    completed, chatted = llm.complete(prompt), llm.chat(messages)

    async def run() -> tuple[Any, ...]:
        acompleted = await llm.acomplete(prompt)
        streamed = [item async for item in await llm.astream_complete(prompt)]
        achatted = await llm.achat(messages)
        chat_streamed = [item async for item in await llm.astream_chat(messages)]
        return acompleted, streamed, achatted, chat_streamed

    acompleted, streamed, achatted, chat_streamed = asyncio.run(run())
    assert acompleted.text == completed.text == "".join(item.delta for item in streamed) == streamed[-1].text
    assert acompleted.raw["usage"]["prompt_tokens"] == completed.raw["usage"]["prompt_tokens"]
    assert achatted.message.content == chatted.message.content == chat_streamed[-1].message.content


# ------------------------------------------------------------------------------------------------ LlamaIndex engines
def test_segment_synthesizer_in_llama_index_query_engines_reuses_each_node(
    tmp_path: Path, tiny_model: Path, nodes
) -> None:
    """A fresh cache (nothing precomputed): the first query encodes each node's entry, the second reuses it."""
    llm = HypicLLM(model_path=str(tiny_model), cache_dir=str(tmp_path / "cache"), seam_tokens=SEAM, device="cpu",
                   max_new_tokens=6)
    try:
        index = VectorStoreIndex([node.model_copy() for node in nodes])
        question = SMALL_CORPUS_QUESTIONS["volcano.md"]
        engine = index.as_query_engine(llm=llm, response_synthesizer=HypicSynthesizer(llm=llm), similarity_top_k=2)
        assert isinstance(engine, RetrieverQueryEngine)
        first, second = engine.query(question), engine.query(question)
        assert first.metadata["usage"]["cache_misses"] == 3 and first.metadata["usage"]["cache_hits"] == 0
        assert second.metadata["usage"]["cache_hits"] == 3 and second.metadata["usage"]["cache_misses"] == 0
        assert second.response == first.response
        assert second.source_nodes[0].node.ref_doc_id == "volcano.md"

        reordered = RetrieverQueryEngine(index.as_retriever(similarity_top_k=3),
                                         response_synthesizer=HypicSynthesizer(llm=llm, streaming=True))
        streamed = reordered.query(question)
        assert isinstance(streamed, StreamingResponse)
        "".join(streamed.response_gen)
        usage = streamed.metadata["usage"]
        assert usage["cache_hits"] == 3 and usage["cache_misses"] == 1  # prefix and the two nodes; one new node

        hypic = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=2), llm=llm).query(question)
        assert hypic.response == second.response and hypic.metadata["usage"] == second.metadata["usage"]
    finally:
        llm.runtime.close()


def test_context_chat_engines_compose_nodes_as_segments(index: VectorStoreIndex, llm: HypicLLM,
                                                         recorder: Recorder) -> None:
    question = SMALL_CORPUS_QUESTIONS["bicycles.md"]
    engine = HypicContextChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=2), llm=llm,
                                                  system_prompt="Answer in one line.")
    first = engine.chat(question)
    texts = [node_text(item) for item in first.source_nodes]
    prompt = recorder.named("LLMCompletionStartEvent")[-1].prompt
    assert all(llm.runtime.prompt_format.chunk(text) in prompt for text in texts)
    assert prompt.startswith("system: Use the context information below") and prompt.endswith(
        f"user: {question}\nassistant:")
    usage = first.metadata["usage"]
    assert usage["cache_hits"] >= len(texts)  # every node's entry, as ingestion encoded it
    assert "\n" not in first.response

    second = engine.chat(question)
    again = second.metadata["usage"]
    assert again["cache_hits"] == usage["cache_hits"] + usage["cache_misses"]  # all of turn 1's segments reused
    assert again["cache_misses"] == 2  # turn 1's question and answer, each a new segment
    prompt = recorder.named("LLMCompletionStartEvent")[-1].prompt
    assert f"user: {question}\n" in prompt and f"assistant: {first.response}\n" in prompt

    def fresh() -> HypicContextChatEngine:
        return HypicContextChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=2), llm=llm,
                                                    system_prompt="Answer in one line.")

    assert "".join(fresh().stream_chat(question).response_gen) == first.response

    async def async_turns() -> tuple[str, str]:
        replied = await fresh().achat(question)
        streamed = await fresh().astream_chat(question)
        return replied.response, "".join([delta async for delta in streamed.async_response_gen()])

    assert asyncio.run(async_turns()) == (first.response, first.response)

    condensing = HypicCondensePlusContextChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=2), llm=llm, max_new_tokens=4)
    reply = condensing.chat(question)
    assert reply.metadata["usage"]["cache_hits"] >= 2 and reply.metadata["usage"]["completion_tokens"] <= 4
    assert [item.node.node_id for item in reply.source_nodes] == [item.node.node_id for item in first.source_nodes]
