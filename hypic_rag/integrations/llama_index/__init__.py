"""LlamaIndex integration (llama-index-core 0.14): answer through hypic-rag with each node as its own segment.

    from llama_index.core import Settings, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from hypic_rag.integrations.llama_index import (
        HypicCacheTransformation, HypicEmbedding, HypicLLM, HypicQueryEngine)

    llm = HypicLLM(cache_dir="cache/")              # the bundled default model; segment cache on disk
    Settings.llm, Settings.embed_model = llm, HypicEmbedding()
    nodes = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=200, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
        HypicCacheTransformation(runtime=llm.runtime),   # precompute every node's cache entry
        Settings.embed_model,
    ]).run(documents=documents)
    engine = HypicQueryEngine(retriever=VectorStoreIndex(nodes).as_retriever(similarity_top_k=4), llm=llm)
    response = engine.query("Who founded the Amber Kiln studio?")   # response.source_nodes: the retrieved nodes

One class kind per module:
- `query_engine.HypicQueryEngine` takes any retriever and passes each retrieved node's text to the runtime as its
  own segment (never one concatenated string), so a node's cached entry is reused wherever it lands in a prompt.
- `llm.HypicLLM` is a LlamaIndex LLM for `Settings.llm`: plain completion (a prompt whose segments are separated
  by `<<PIC_SEP>>` reuses each segment's cache entry; the last segment is the query) and chat (each earlier
  message is its own cached segment); text no separator marks is cut around the nodes the runtime knows
  (`hypic_rag.prompting.matching`), so LlamaIndex's own engines (`index.as_query_engine()`, chat engines) reuse them too.
- `ingestion.HypicCacheTransformation` is an ingestion step that encodes every node's segment-cache entry ahead
  of queries.
- `embedding.HypicEmbedding` wraps the shipped all-MiniLM-L6-v2 sentence-transformers model (offline).
- `runtime.HypicRuntime` is the `hypic_rag.pipeline.session.ModelSession` (model, engine, segment cache, prompt format)
  they share, one per model and cache directory, with one scheduler (continuous batching) that runs every
  generation of the LLM, the synthesizer and the query engine, so concurrent calls batch.
The integration imports nothing from `hypic_rag.server`: separated segments are `hypic_rag.prompting.segments`, token
accounting `hypic_rag.pipeline.usage`.
"""

from __future__ import annotations

import importlib

_NEEDED = (
    "llama_index.core.base.embeddings.base",
    "llama_index.core.base.llms.types",
    "llama_index.core.base.response.schema",
    "llama_index.core.chat_engine",
    "llama_index.core.llms.custom",
    "llama_index.core.query_engine",
    "llama_index.core.response_synthesizers",
    "llama_index.core.schema",
)
try:
    for _name in _NEEDED:
        importlib.import_module(_name)
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hypic_rag.integrations.llama_index needs llama-index-core 0.14: install it with "
        "`pip install 'hypic-rag[llamaindex]'` (or `pip install 'llama-index-core>=0.14,<0.15'`)"
    ) from error

from hypic_rag.integrations.llama_index.condense_plus_context_chat_engine import (  # noqa: E402
    HypicCondensePlusContextChatEngine,
)
from hypic_rag.integrations.llama_index.context_chat_engine import HypicContextChatEngine  # noqa: E402
from hypic_rag.integrations.llama_index.embedding import HypicEmbedding  # noqa: E402
from hypic_rag.integrations.llama_index.ingestion import HypicCacheTransformation  # noqa: E402
from hypic_rag.errors import PromptTooLongError  # noqa: E402
from hypic_rag.integrations.llama_index.llm import HypicLLM, segmented_messages_to_prompt  # noqa: E402
from hypic_rag.integrations.llama_index.query_engine import HypicQueryEngine  # noqa: E402
from hypic_rag.integrations.llama_index.runtime import HypicRuntime  # noqa: E402
from hypic_rag.integrations.llama_index.synthesizer import SUPPORTED_RESPONSE_MODES, HypicSynthesizer  # noqa: E402

__all__ = [
    "SUPPORTED_RESPONSE_MODES",
    "HypicCacheTransformation",
    "HypicCondensePlusContextChatEngine",
    "HypicContextChatEngine",
    "HypicEmbedding",
    "HypicLLM",
    "HypicQueryEngine",
    "HypicRuntime",
    "HypicSynthesizer",
    "PromptTooLongError",
    "segmented_messages_to_prompt",
]
