"""Retrieval recall of the chunks a question needs, for each embedding context and neighbour expansion
(`hypic_rag.retrieval.chunk_context`), on documents longer than one chunk.

Two corpora per world seed, both the cross-chunk worlds' documents (`training/data/cross_chunk_qa.py`: two
paragraphs per entity, the second never naming it) and their questions:

- `test-bed`: the cross-chunk test bed as the evaluations index it (`.md` files, `cross_chunk_chunker`: 48 tokens,
  one paragraph per chunk); a question needs the chunks its `needed_chunks` names.
- `generic`: the same text through the project's default chunker settings at 32 tokens (`ChunkerConfig(32)`,
  paragraph fill 0.5) as `.txt` files with a Markdown-free layout, so chunk boundaries fall where the chunker puts
  them (a paragraph may be cut in two); a question needs the document's first chunk (which names the entity) and
  every chunk that overlaps its answer's sentence. `generic-titled`: the same documents as Markdown with the
  entity's name as a heading (`# Name`), as many real documents are written: the chunks carry it as their
  `section`.

For each corpus and embedding context one index is built (the real chunker, MiniLM, FAISS flat), and each
question is searched with every neighbour expansion at k = 8 with the pipeline's two hop places. Recall: the share
of questions whose needed chunks are all among the k hits, for cross-chunk and single-chunk questions apart.

    OMP_WAIT_POLICY=PASSIVE python -m evals.retrieval_recall --seed 912000000 --questions 200 \\
        --out docs/benchmarks/retrieval_recall_912.json --markdown docs/benchmarks/retrieval_recall_912.md
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypic_rag.retrieval.chunk_context import EMBEDDING_CONTEXTS, RetrievalSettings
from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.loading import load_corpus
from hypic_rag.retrieval.manifest import ModelIdentity
from training.data.cross_chunk_qa import (cross_chunk_chunker, generate_cross_chunk_questions,
                                          generate_cross_chunk_world, write_cross_chunk_corpus)

logger = logging.getLogger(__name__)

CORPORA = ("test-bed", "generic", "generic-titled")
NEIGHBOURS = ("none:0", "next:1", "next:2", "next:3", "both:2", "both:4")
GENERIC_CHUNK_TOKENS = 32


def _write_generic(world: Any, directory: Path, titled: bool) -> Path:
    """The world's documents as plain text (`.txt`) or, titled, as Markdown under a heading of the entity's name."""
    directory.mkdir(parents=True, exist_ok=True)
    for document in world.documents:
        if titled:
            (directory / f"{document.doc_id}.md").write_text(f"# {document.name}\n\n{document.text}\n", "utf-8")
        else:
            (directory / f"{document.doc_id}.txt").write_text(document.text + "\n", "utf-8")
    return directory


def _needed_positions(corpus: str, world: Any, question: Any, chunker: Chunker,
                      loaded: dict[str, Any]) -> set[tuple[str, int]]:
    """(doc_id as the index names it, chunk position) of every chunk `question` needs in `corpus`."""
    document = next(doc for doc in world.documents if doc.doc_id == question.gold_doc_ids[0])
    source = loaded[document.doc_id]
    if corpus == "test-bed":
        return {(source.doc_id, position) for position in question.needed_chunks}
    _, sentence, _ = document.facts[question.relations[0]]
    start = source.text.index(sentence)
    end = start + len(sentence)
    chunks = chunker.chunk_document(source)
    needed = {(source.doc_id, 0)}
    needed.update((source.doc_id, chunk.position) for chunk in chunks
                  if chunk.char_start < end and chunk.char_end > start)
    return needed


def measure(seed: int, questions: int, *, k: int = 8, hop_slots: int = 2, corpora: Sequence[str] = CORPORA,
            contexts: Sequence[str] = EMBEDDING_CONTEXTS, neighbours: Sequence[str] = NEIGHBOURS,
            questions_per_world: int = 50) -> dict[str, Any]:
    """Recall per corpus, embedding context and neighbour expansion over `questions` questions of worlds `seed`,
    `seed + 1`, ... (see the module docstring)."""
    from transformers import AutoTokenizer

    from hypic_rag import default_model_path
    from hypic_rag.runtime.model import tokenizer_digest

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    embedder = SentenceEmbedder()
    identity = ModelIdentity("recall-eval", "recall-eval", tokenizer_digest(tokenizer))
    chunkers = {"test-bed": cross_chunk_chunker(tokenizer),
                "generic": Chunker(tokenizer, ChunkerConfig(chunk_tokens=GENERIC_CHUNK_TOKENS)),
                "generic-titled": Chunker(tokenizer, ChunkerConfig(chunk_tokens=GENERIC_CHUNK_TOKENS))}
    counts: dict[tuple[str, str, str, str], list[bool]] = {}
    chunks_per_document: dict[str, list[int]] = {corpus: [] for corpus in corpora}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        produced, world_seed = 0, seed
        while produced < questions:
            world = generate_cross_chunk_world(world_seed)
            asked = generate_cross_chunk_questions(world, world_seed, min(questions_per_world, questions - produced))
            for corpus in corpora:
                root = Path(scratch) / f"{corpus}-{world_seed}"
                if corpus == "test-bed":
                    documents_dir = write_cross_chunk_corpus(world, asked, root)
                else:
                    documents_dir = _write_generic(world, root / "documents", titled=corpus == "generic-titled")
                loaded_corpus = load_corpus(documents_dir)
                loaded = {Path(document.doc_id).stem: document for document in loaded_corpus.documents}
                chunker = chunkers[corpus]
                chunks_per_document[corpus] += [len(chunker.chunk_document(doc)) for doc in loaded_corpus.documents]
                needed = [_needed_positions(corpus, world, question, chunker, loaded) for question in asked]
                for context in contexts:
                    settings = RetrievalSettings(context, "none", 0)
                    with CorpusIndex.open_for_update(root / f"index-{context}", embedder,
                                                     IndexConfig(model=identity, chunker=chunker.config,
                                                                 retrieval=settings)) as index:
                        index.ingest(loaded_corpus, chunker)
                        for spec in neighbours:
                            found = index.search_many([question.text for question in asked], [k] * len(asked),
                                                      hop_slots=hop_slots, neighbours=spec)
                            for question, hits, wanted in zip(asked, found, needed):
                                got = {(hit.chunk.doc_id, hit.chunk.position) for hit in hits}
                                counts.setdefault((corpus, context, spec, question.kind), []).append(wanted <= got)
            produced += len(asked)
            logger.info("world %d: %d questions (%.0f s)", world_seed, produced, time.perf_counter() - began)
            world_seed += 1
    rows = []
    for corpus in corpora:
        for context in contexts:
            for spec in neighbours:
                cross = counts.get((corpus, context, spec, "cross"), [])
                single = counts.get((corpus, context, spec, "single"), [])
                both = cross + single
                rows.append({"corpus": corpus, "embedding_context": context, "neighbours": spec,
                             "recall": sum(both) / len(both), "cross_recall": sum(cross) / max(1, len(cross)),
                             "single_recall": sum(single) / max(1, len(single)),
                             "cross_questions": len(cross), "single_questions": len(single)})
    return {"seed": seed, "questions": questions, "k": k, "hop_slots": hop_slots,
            "chunks_per_document": {corpus: sum(values) / len(values) for corpus, values in chunks_per_document.items()},
            "generic_chunk_tokens": GENERIC_CHUNK_TOKENS, "rows": rows,
            "seconds": round(time.perf_counter() - began, 1), "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


def markdown(report: dict[str, Any]) -> str:
    """The report as one table per corpus."""
    lines = [f"Retrieval recall of the needed chunks, worlds {report['seed']}+ ({report['questions']} questions per "
             f"corpus), k = {report['k']}, {report['hop_slots']} hop places. Chunks per document: "
             + ", ".join(f"{corpus} {value:.2f}" for corpus, value in report["chunks_per_document"].items()), ""]
    for corpus in dict.fromkeys(row["corpus"] for row in report["rows"]):
        rows = [row for row in report["rows"] if row["corpus"] == corpus]
        lines += [f"**{corpus}** ({rows[0]['cross_questions']} cross-chunk, {rows[0]['single_questions']} "
                  "single-chunk questions)", "",
                  "| embedding context | neighbours | recall | cross-chunk | single-chunk |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {row['embedding_context']} | {row['neighbours']} | {100 * row['recall']:.1f}% | "
                  f"{100 * row['cross_recall']:.1f}% | {100 * row['single_recall']:.1f}% |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=912_000_000)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--hop-slots", type=int, default=2)
    parser.add_argument("--corpora", default=",".join(CORPORA))
    parser.add_argument("--contexts", default=",".join(EMBEDDING_CONTEXTS))
    parser.add_argument("--neighbours", default=",".join(NEIGHBOURS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    report = measure(args.seed, args.questions, k=args.k, hop_slots=args.hop_slots,
                     corpora=args.corpora.split(","), contexts=args.contexts.split(","),
                     neighbours=args.neighbours.split(","))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
