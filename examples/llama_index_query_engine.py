#!/usr/bin/env python
"""LlamaIndex: a VectorStoreIndex retriever answered through hypic-rag, each retrieved node its own segment.

    python examples/llama_index_query_engine.py [--model PATH]

Offline: the embed model is the shipped all-MiniLM-L6-v2 (`HypicEmbedding`), the LLM the bundled default model
(`HypicLLM`), both set on `Settings` so nothing reaches for OpenAI. The first query encodes the retrieved nodes'
cache entries on the way; later queries over the same nodes reuse them (see `llama_index_ingestion.py` to
precompute them all at ingestion instead).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter

from hypic_rag import example_corpus_path, read_questions
from hypic_rag.integrations.llama_index import HypicEmbedding, HypicLLM, HypicQueryEngine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bundled default model)")
    parser.add_argument("--questions", type=int, default=4, help="questions asked (4)")
    args = parser.parse_args()

    llm = HypicLLM(model_path=str(args.model) if args.model else None, max_new_tokens=24)
    Settings.llm = llm
    Settings.embed_model = HypicEmbedding()
    Settings.node_parser = SentenceSplitter(chunk_size=256, chunk_overlap=0, tokenizer=llm.runtime.tokenize)

    documents = SimpleDirectoryReader(str(example_corpus_path() / "documents"), required_exts=[".md"]).load_data()
    index = VectorStoreIndex.from_documents(documents)
    engine = HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=8), llm=llm)

    for question in read_questions(example_corpus_path() / "questions.jsonl")[: args.questions]:
        response = engine.query(question.text)
        usage, timings = response.metadata["usage"], response.metadata["timings"]
        print(f"Q: {question.text}")
        print(f"  answer: {response.response!r}   (expected: {question.answer})")
        for item in response.source_nodes[:3]:
            print(f"    source {item.node.metadata['file_name']} score {item.score:.3f}")
        print(f"  tokens: {usage['prompt_tokens']} prompt, {usage['recomputed_tokens']} recomputed; segments "
              f"{usage['cache_hits']} hit / {usage['cache_misses']} encoded; time to first token "
              f"{1000 * timings['time_to_first_token']:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
