"""The LlamaIndex integration end to end with real LlamaIndex components: an IngestionPipeline with the cache
transformation, a VectorStoreIndex over the offline MiniLM embed model, and the hypic query engine and LLM.

A tiny random model generates (answers are gibberish; answer correctness is in
test_llama_index_default_model.py); retrieval, source nodes, segment layout, cache reuse and streaming are real.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, Settings, SummaryIndex, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import Response, StreamingResponse  # noqa: E402
from llama_index.core.ingestion import IngestionPipeline  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter, TokenTextSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode  # noqa: E402

from hypic_rag.integrations.llama_index import (  # noqa: E402
    HypicCacheTransformation,
    HypicEmbedding,
    HypicLLM,
    HypicQueryEngine,
)
from hypic_rag.integrations.llama_index.layout import document_order, node_follows  # noqa: E402
from hypic_rag.runtime.recompute_policy import as_policy  # noqa: E402
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS  # noqa: E402

SEAM = 8
TOP_K = 2


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):
    model = tiny_model
    cache_dir = tmp_path_factory.mktemp("llama_index") / "segment_cache"
    hypic_llm = HypicLLM(model_path=str(model), cache_dir=str(cache_dir), seam_tokens=SEAM, device="cpu",
                         max_new_tokens=6)
    previous = (Settings._llm, Settings._embed_model)
    Settings.llm = hypic_llm
    Settings.embed_model = HypicEmbedding()
    yield hypic_llm
    Settings._llm, Settings._embed_model = previous
    hypic_llm.runtime.close()


def documents() -> list[Document]:
    return [Document(text=text, id_=name, metadata={"file_name": name}) for name, text in SMALL_CORPUS.items()]


def ingestion(llm: HypicLLM) -> IngestionPipeline:
    return IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=96, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
            HypicCacheTransformation(runtime=llm.runtime),
            Settings.embed_model,
        ]
    )


@pytest.fixture(scope="module")
def nodes(llm: HypicLLM):
    pipeline = ingestion(llm)
    ingested = pipeline.run(documents=documents())
    transformation = pipeline.transformations[1]
    assert transformation.last_stats.cache_misses == len(ingested) + 1  # every node and the prompt prefix
    assert transformation.last_stats.cache_hits == 0
    return ingested


@pytest.fixture(scope="module")
def index(nodes) -> VectorStoreIndex:
    return VectorStoreIndex(nodes)


# ------------------------------------------------------------------------------------------------ ingestion
def test_transformation_marks_nodes_and_hides_the_mark(nodes, llm: HypicLLM) -> None:
    assert len(nodes) == len(SMALL_CORPUS)
    for node in nodes:
        text = node.get_content(metadata_mode=MetadataMode.NONE)
        assert node.metadata["hypic_segment_tokens"] == len(llm.runtime.chunk_ids(text))
        assert "hypic_segment_tokens" not in node.get_content(metadata_mode=MetadataMode.EMBED)
        assert "hypic_segment_tokens" not in node.get_content(metadata_mode=MetadataMode.LLM)
        assert node.embedding is not None and len(node.embedding) == 384


def test_ingesting_again_finds_every_entry_cached(nodes, llm: HypicLLM) -> None:
    pipeline = ingestion(llm)
    again = pipeline.run(documents=documents())
    stats = pipeline.transformations[1].last_stats
    assert len(again) == len(nodes)
    assert stats.cache_hits == len(nodes) + 1 and stats.cache_misses == 0


# ------------------------------------------------------------------------------------------------ query engine
@pytest.mark.parametrize("document", list(SMALL_CORPUS_QUESTIONS))
def test_query_engine_answers_with_the_right_source_nodes(
    index: VectorStoreIndex, llm: HypicLLM, document: str
) -> None:
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=TOP_K), llm=llm)
    question = SMALL_CORPUS_QUESTIONS[document]
    response = engine.query(question)
    assert isinstance(response, Response)
    assert len(response.source_nodes) == TOP_K
    assert response.source_nodes[0].node.ref_doc_id == document
    assert response.source_nodes[0].node.metadata["file_name"] == document
    usage = response.metadata["usage"]
    assert usage["cache_misses"] == 0 and usage["cache_hits"] == TOP_K + 1  # precomputed at ingestion
    # each node is its own segment: the prompt is prefix + one chunk segment per node + question
    runtime = llm.runtime
    node_tokens = [len(runtime.chunk_ids(n.node.get_content(metadata_mode=MetadataMode.NONE)))
                   for n in response.source_nodes]
    prefix = runtime.tokenize(runtime.prompt_format.prefix)
    question_tokens = runtime.tokenize(runtime.prompt_format.question(question))
    assert usage["prompt_tokens"] == len(prefix) + sum(node_tokens) + len(question_tokens)
    assert usage["recomputed_tokens"] == len(question_tokens) + sum(min(SEAM, n) for n in node_tokens)
    assert response.metadata["mode"] == "hypic"


@pytest.mark.parametrize("document", ["bicycles.md", "volcano.md", "astronomy.md"])
def test_query_engine_streams_the_same_answer(index: VectorStoreIndex, llm: HypicLLM, document: str) -> None:
    question = SMALL_CORPUS_QUESTIONS[document]
    retriever = index.as_retriever(similarity_top_k=TOP_K)
    plain = HypicQueryEngine(retriever=retriever, llm=llm).query(question)
    streamed = HypicQueryEngine(retriever=retriever, llm=llm, streaming=True).query(question)
    assert isinstance(streamed, StreamingResponse)
    text = "".join(streamed.response_gen)
    assert text == plain.response  # the deltas are stripped as the answer is
    assert [n.node.node_id for n in streamed.source_nodes] == [n.node.node_id for n in plain.source_nodes]
    assert streamed.metadata["usage"] == plain.metadata["usage"]


@pytest.mark.parametrize("document", ["volcano.md", "astronomy.md", "lavender.md"])
def test_query_engine_stream_adds_up_to_the_answer_when_sampling(
    index: VectorStoreIndex, llm: HypicLLM, document: str
) -> None:
    sampler = HypicLLM(runtime=llm.runtime, temperature=1.3, seed=11, max_new_tokens=10)
    retriever = index.as_retriever(similarity_top_k=TOP_K)
    plain = HypicQueryEngine(retriever=retriever, llm=sampler).query(SMALL_CORPUS_QUESTIONS[document])
    question = SMALL_CORPUS_QUESTIONS[document]
    streamed = HypicQueryEngine(retriever=retriever, llm=sampler, streaming=True).query(question)
    deltas = list(streamed.response_gen)
    assert "".join(deltas) == plain.response and all(deltas)


def test_concurrent_async_queries_batch_and_equal_the_same_queries_one_by_one(
    index: VectorStoreIndex, llm: HypicLLM
) -> None:
    """The LLM and the query engine share the runtime's scheduler: `aquery` / `acomplete` awaited together run in
    the same batched steps, and each answer is the one the same call gets alone."""
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=TOP_K), llm=llm)
    questions = list(SMALL_CORPUS_QUESTIONS.values())
    prompt = "Ingrid Holm keeps the Kestrel Bay lighthouse.<<PIC_SEP>>Who keeps the lighthouse?"  # its own segment
    alone = [engine.query(question).response for question in questions]
    completion = llm.complete(prompt).text
    reports = []
    scheduler = llm.runtime.scheduler
    scheduler.on_step = reports.append

    async def together() -> tuple[list, list]:
        answers = await asyncio.gather(*(engine.aquery(question) for question in questions))
        completions = await asyncio.gather(*(llm.acomplete(prompt) for _ in range(3)))
        streamed = await llm.astream_complete(prompt)
        deltas = [response.delta async for response in streamed]
        return list(answers), [c.text for c in completions] + ["".join(deltas)]

    try:
        answers, completions = asyncio.run(together())
    finally:
        scheduler.on_step = None
    assert [answer.response for answer in answers] == alone
    assert all(isinstance(answer, Response) and answer.metadata["usage"]["cache_misses"] == 0 for answer in answers)
    assert completions == [completion] * 4
    assert max(report.sequences for report in reports) > 1, "the concurrent queries were not batched"


def test_llm_sampling_is_fresh_without_a_seed_and_reproducible_with_one(llm: HypicLLM) -> None:
    prompt = "<<PIC_SEP>>".join(["Ines keeps bees on the hill.", "Who keeps bees?"])
    unseeded = [llm.complete(prompt, temperature=1.0, max_new_tokens=8).text for _ in range(5)]
    assert len(set(unseeded)) > 1, unseeded
    seeded = [llm.complete(prompt, temperature=1.0, max_new_tokens=8, seed=9).text for _ in range(3)]
    assert len(set(seeded)) == 1, seeded
    sampler = HypicLLM(runtime=llm.runtime, temperature=1.0, seed=9, max_new_tokens=8)
    assert sampler.complete(prompt).text == seeded[0]
    streamed = list(sampler.stream_complete(prompt))
    assert "".join(item.delta for item in streamed) == streamed[-1].text == seeded[0]
    assert len({HypicLLM(runtime=llm.runtime, temperature=1.0, max_new_tokens=8).complete(prompt).text
                for _ in range(5)}) > 1
    with pytest.raises(ValueError):
        HypicLLM(runtime=llm.runtime, seed=2**64)


def test_query_engine_takes_any_retriever(nodes, llm: HypicLLM) -> None:
    retriever = SummaryIndex(nodes).as_retriever()  # returns every node, no embeddings involved
    response = HypicQueryEngine(retriever=retriever, llm=llm, mode="full").query("Who grows lavender?")
    assert len(response.source_nodes) == len(nodes)
    usage = response.metadata["usage"]
    assert usage["recomputed_tokens"] == usage["prompt_tokens"] and response.metadata["mode"] == "full"


def test_a_chained_policy_reads_chained_entries_through_llama_index(tmp_path: Path, tiny_model: Path) -> None:
    """One document cut into several nodes by LlamaIndex's node parser, all retrieved in document order: the
    synthesizer marks each node after the first as following the one before it (its PREVIOUS relationship), so a
    chained policy reads chained entries. Observed as cache misses: after the anchored entries are cached, the
    chained policy misses every node's entry but the first (without the marks it would read the anchored ones)."""
    chained_llm = HypicLLM(model_path=str(tiny_model), cache_dir=str(tmp_path / "cache"), seam_tokens=SEAM,
                           device="cpu", max_new_tokens=2)
    try:
        splitter = TokenTextSplitter(chunk_size=64, chunk_overlap=0, tokenizer=chained_llm.runtime.tokenize)
        document = Document(text=" ".join(SMALL_CORPUS.values()), id_="corpus.md")
        nodes = splitter.get_nodes_from_documents([document])
        assert len(nodes) >= 3
        assert node_follows(nodes) == [False] + [True] * (len(nodes) - 1)
        assert node_follows([nodes[1], nodes[0], nodes[2]]) == [False, False, False]  # out of document order

        engine = chained_llm.runtime.engine
        query = HypicQueryEngine(retriever=SummaryIndex(nodes).as_retriever(), llm=chained_llm)
        engine.recompute_policy = as_policy("seam+anchored")
        query.query("Who grows lavender?")  # every node's anchored entry is now cached
        engine.recompute_policy = as_policy("seam+chained")
        first = query.query("Who grows lavender?").metadata["usage"]
        again = query.query("Who grows lavender?").metadata["usage"]
    finally:
        chained_llm.runtime.close()
    assert first["cache_misses"] == len(nodes) - 1  # the chained entries of nodes 2..n, encoded and kept
    assert again["cache_misses"] == 0 and again["cache_hits"] == first["cache_hits"] + len(nodes) - 1


def test_nodes_are_put_in_document_order_so_chained_entries_are_read(tmp_path: Path, tiny_model: Path) -> None:
    """A vector retriever returns one document's nodes by similarity, not as written: the synthesizer puts them
    back in document order (`layout.document_order`: start_char_idx, else PREVIOUS / NEXT), so each node after the
    first follows its antecedent and a chained policy reads chained entries (n - 1 chained misses after the anchored
    entries are cached; in LlamaIndex's order most nodes would not follow the node before them)."""
    chained_llm = HypicLLM(model_path=str(tiny_model), cache_dir=str(tmp_path / "cache"), seam_tokens=SEAM,
                           device="cpu", max_new_tokens=2)
    try:
        splitter = SentenceSplitter(chunk_size=48, chunk_overlap=0, tokenizer=chained_llm.runtime.tokenize)
        first_document = Document(text=" ".join(SMALL_CORPUS.values()), id_="corpus.md")
        nodes = splitter.get_nodes_from_documents([first_document])
        other = splitter.get_nodes_from_documents([Document(text="The ferry leaves at noon.", id_="ferry.md")])
        assert len(nodes) >= 3 and all(node.start_char_idx is not None for node in nodes)
        shuffled = [nodes[2], other[0], nodes[0], *nodes[3:], nodes[1]]
        assert [node.node_id for node in document_order(shuffled)] == [node.node_id for node in [*nodes, other[0]]]
        for node in nodes:  # without character offsets the PREVIOUS / NEXT relationships give the same order
            node.start_char_idx = None
        assert [node.node_id for node in document_order(shuffled)] == [node.node_id for node in [*nodes, other[0]]]

        retriever = VectorStoreIndex(nodes, embed_model=HypicEmbedding()).as_retriever(similarity_top_k=len(nodes))
        retrieved = [item.node.node_id for item in retriever.retrieve("Who grows lavender?")]
        assert retrieved != [node.node_id for node in nodes]  # LlamaIndex's order is not the document's
        assert node_follows([item.node for item in retriever.retrieve("Who grows lavender?")]).count(True) < len(nodes) - 1
        engine = chained_llm.runtime.engine
        query = HypicQueryEngine(retriever=retriever, llm=chained_llm)
        engine.recompute_policy = as_policy("seam+anchored")
        query.query("Who grows lavender?")  # every node's anchored entry is now cached
        engine.recompute_policy = as_policy("seam+chained")
        usage = query.query("Who grows lavender?").metadata["usage"]
    finally:
        chained_llm.runtime.close()
    assert usage["cache_misses"] == len(nodes) - 1  # every node after the first read its chained entry


def test_query_engine_uses_settings_llm_by_default(index: VectorStoreIndex, llm: HypicLLM) -> None:
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=1))
    assert engine.llm is llm
    assert HypicQueryEngine.class_name() == "HypicQueryEngine"
    with pytest.raises(ValueError, match="unknown mode"):
        HypicQueryEngine(retriever=index.as_retriever(), llm=llm, mode="fast")


# ------------------------------------------------------------------------------------------------ LLM
def test_llm_completion_reuses_separated_segments(llm: HypicLLM) -> None:
    prompt = "<<PIC_SEP>>".join(["Orla keeps goats.", "The goats are called Fen and Moss.", "Who keeps goats?"])
    first = Settings.llm.complete(prompt)
    second = Settings.llm.complete(prompt)
    assert first.additional_kwargs["cache_misses"] == 2 and second.additional_kwargs["cache_hits"] == 2
    assert second.additional_kwargs["cache_misses"] == 0
    assert second.text == first.text and second.additional_kwargs["completion_tokens"] >= 1
    assert second.additional_kwargs["recomputed_tokens"] < second.additional_kwargs["prompt_tokens"]
    streamed = list(Settings.llm.stream_complete(prompt))
    assert "".join(item.delta for item in streamed) == streamed[-1].text == first.text


def test_llm_chat_caches_every_earlier_message(llm: HypicLLM) -> None:
    system = ChatMessage(role="system", content="You answer questions about goats in one word.")
    first = Settings.llm.chat([system, ChatMessage(role="user", content="How many goats?")])
    second = Settings.llm.chat([system, ChatMessage(role="user", content="Which goat is older?")])
    assert first.message.role.value == "assistant"
    assert isinstance(second.message.content, str)
    usage = second.message.additional_kwargs  # LlamaIndex keeps a completion's extras on the chat message
    assert usage["cache_hits"] == 1 and usage["cache_misses"] == 0  # the system message, reused


def test_llm_follows_llama_index_conventions(llm: HypicLLM) -> None:
    assert HypicLLM.class_name() == "HypicLLM"
    data = llm.to_dict()
    assert data["class_name"] == "HypicLLM" and data["max_new_tokens"] == 6 and data["mode"] == "hypic"
    assert llm.metadata.num_output == 6 and llm.metadata.context_window > 0 and not llm.metadata.is_chat_model
    assert HypicEmbedding.class_name() == "HypicEmbedding" and HypicCacheTransformation.class_name()
    with pytest.raises(ValueError):
        HypicLLM(model_path=llm.model_path, max_new_tokens=0)


def test_llm_works_inside_a_stock_llama_index_query_engine(index: VectorStoreIndex, llm: HypicLLM) -> None:
    """Plain completion path: LlamaIndex's own synthesizer sends one formatted prompt."""
    response = index.as_query_engine(llm=llm, similarity_top_k=1).query(SMALL_CORPUS_QUESTIONS["chess.md"])
    assert response.source_nodes[0].node.ref_doc_id == "chess.md"
    assert isinstance(response.response, str)


def test_missing_llama_index_raises_a_helpful_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "hypic_rag.integrations.llama_index")
    for name in [name for name in sys.modules if name == "llama_index" or name.startswith("llama_index.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if llama-index-core were not installed
    with pytest.raises(ImportError, match=r"pip install 'hypic-rag\[llamaindex\]'"):
        importlib.import_module("hypic_rag.integrations.llama_index")


def test_package_exposes_the_classes_lazily() -> None:
    import hypic_rag.integrations as integrations

    assert integrations.HypicLLM is HypicLLM
    with pytest.raises(AttributeError):
        integrations.NotAThing  # noqa: B018


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        HypicLLM(model_path=str(tmp_path / "nowhere"))
