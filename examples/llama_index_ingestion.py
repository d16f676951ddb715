#!/usr/bin/env python
"""LlamaIndex ingestion that precomputes hypic-rag segment-cache entries, on disk, for every node.

    python examples/llama_index_ingestion.py [--cache-dir DIR] [--model PATH]

An `IngestionPipeline` splits the bundled example corpus, encodes each node's cache entry
(`HypicCacheTransformation`, persisted in `--cache-dir`) and embeds it (`HypicEmbedding`, offline). Run it twice
with the same `--cache-dir`: the second run finds every entry cached. Queries then load the nodes' entries instead
of recomputing them: only seams and the question are run through the model.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter

from hypic_rag import example_corpus_path, read_questions
from hypic_rag.integrations.llama_index import HypicCacheTransformation, HypicEmbedding, HypicLLM, HypicQueryEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, help="segment cache directory (default: a temporary one)")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bundled default model)")
    args = parser.parse_args()
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="hypic-llama-")) / "segment_cache"

    llm = HypicLLM(model_path=str(args.model) if args.model else None, cache_dir=str(cache_dir), max_new_tokens=24)
    Settings.llm, Settings.embed_model = llm, HypicEmbedding()
    cache_step = HypicCacheTransformation(runtime=llm.runtime)
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=256, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
            cache_step,
            Settings.embed_model,
        ]
    )
    documents = SimpleDirectoryReader(str(example_corpus_path() / "documents"), required_exts=[".md"]).load_data()
    began = time.perf_counter()
    nodes = pipeline.run(documents=documents)
    stats = cache_step.last_stats
    print(f"ingested {len(documents)} documents into {len(nodes)} nodes in {time.perf_counter() - began:.1f} s; "
          f"segment cache {cache_dir}: {stats.cache_misses} entries encoded, {stats.cache_hits} already there")

    engine = HypicQueryEngine(retriever=VectorStoreIndex(nodes).as_retriever(similarity_top_k=8), llm=llm)
    for question in read_questions(example_corpus_path() / "questions.jsonl")[:3]:
        response = engine.query(question.text)
        usage, timings = response.metadata["usage"], response.metadata["timings"]
        print(f"Q: {question.text}\n  answer: {response.response!r}   (expected: {question.answer}); "
              f"top source {response.source_nodes[0].node.metadata['file_name']}; segments {usage['cache_hits']} "
              f"hit / {usage['cache_misses']} encoded; "
              f"time to first token {1000 * timings['time_to_first_token']:.0f} ms")
    llm.runtime.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
