"""Held-out QA cases whose context comes from the real retriever (FAISS + the shipped MiniLM embedder).

Each held-out world is written out as a corpus, indexed with `hypic_rag.retrieval` exactly as a user's corpus is
(chunker, docstore, FAISS), and each question's k chunks are the top-k hits for the question text (direct hits best
first, then the retrieval hop's, with the neighbours the index's expansion brings), laid out as the pipeline lays
them out (`pipeline.prompt_order`). Each index is built with `retrieval` (`hypic_rag.retrieval.chunk_context.
RetrievalSettings`; None: a new index's default, `DEFAULT_RETRIEVAL`), as a user's new index is.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.data.synthetic_qa import Question, World, generate_questions, generate_world, write_corpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetrievedCase:
    """A held-out question, the retrieved chunks (text and segment token ids, in prompt order: direct hits best
    first, then the retrieval hop's), their doc ids, similarity to the question and whether the hop found them."""

    world: World
    question: Question
    chunk_texts: list[str]
    chunk_token_ids: list[list[int]]
    retrieved_doc_ids: list[str]
    scores: list[float] = field(default_factory=list)
    from_hop: list[bool] = field(default_factory=list)
    chunk_positions: list[int] = field(default_factory=list)
    """Each retrieved chunk's position in its document (0 = its first chunk)."""

    @property
    def gold_retrieved(self) -> bool:
        """Whether every gold document is among the retrieved chunks."""
        return set(self.question.gold_doc_ids) <= set(self.retrieved_doc_ids)

    @property
    def needed_retrieved(self) -> bool:
        """Whether every chunk the question needs is retrieved: (gold document, position) for each position of its
        `needed_chunks` (cross-chunk questions), else `gold_retrieved`."""
        needed = getattr(self.question, "needed_chunks", None)
        if needed is None:
            return self.gold_retrieved
        found = set(zip(self.retrieved_doc_ids, self.chunk_positions))
        return all((doc_id, position) in found for doc_id in self.question.gold_doc_ids for position in needed)


def retrieved_cases(
    seed: int,
    num_questions: int,
    tokenizer,
    *,
    num_chunks: int = 8,
    two_hop_share: float = 0.2,
    questions_per_world: int = 50,
    hop_slots: int = 2,
    work_dir: str | Path | None = None,
    retrieval: Any = None,
) -> Iterator[RetrievedCase]:
    """Held-out cases of worlds `seed`, `seed + 1`, ... (the same questions as `evaluate.heldout_cases`), each
    world indexed in its own corpus index under `work_dir` (a temporary directory by default) and searched as the
    product's pipeline searches it (`hop_slots` of the k places from one retrieval hop)."""

    def world_of(world_seed: int, count: int) -> tuple[World, list[Question]]:
        world = generate_world(world_seed)
        return world, generate_questions(world, world_seed, count, two_hop_share=two_hop_share)

    yield from _indexed_cases(seed, num_questions, tokenizer, world_of, write_corpus, num_chunks=num_chunks,
                              questions_per_world=questions_per_world, hop_slots=hop_slots, work_dir=work_dir,
                              retrieval=retrieval)


def retrieved_cross_chunk_cases(
    seed: int,
    num_questions: int,
    tokenizer,
    *,
    num_chunks: int = 8,
    cross_share: float = 0.5,
    questions_per_world: int = 50,
    hop_slots: int = 2,
    work_dir: str | Path | None = None,
    retrieval: Any = None,
) -> Iterator[RetrievedCase]:
    """Held-out cases of the cross-chunk worlds `seed`, `seed + 1`, ... (`training.data.cross_chunk_qa`: two-chunk
    documents, half the questions cross-chunk), each world indexed with that test bed's chunker
    (`cross_chunk_chunker`) and searched as `retrieved_cases` searches."""
    from training.data.cross_chunk_qa import (cross_chunk_chunker, generate_cross_chunk_questions,
                                              generate_cross_chunk_world, write_cross_chunk_corpus)

    def world_of(world_seed: int, count: int) -> tuple[Any, list[Any]]:
        world = generate_cross_chunk_world(world_seed)
        return world, generate_cross_chunk_questions(world, world_seed, count, cross_share=cross_share)

    yield from _indexed_cases(seed, num_questions, tokenizer, world_of, write_cross_chunk_corpus,
                              num_chunks=num_chunks, questions_per_world=questions_per_world, hop_slots=hop_slots,
                              work_dir=work_dir, chunker=cross_chunk_chunker(tokenizer), retrieval=retrieval)


def _indexed_cases(
    seed: int, num_questions: int, tokenizer, world_of: Callable[[int, int], tuple[Any, Sequence[Any]]],
    write: Callable[[Any, Sequence[Any], Path], Path], *, num_chunks: int, questions_per_world: int, hop_slots: int,
    work_dir: str | Path | None, chunker: Any = None, retrieval: Any = None,
) -> Iterator[RetrievedCase]:
    """Cases of worlds `seed`, `seed + 1`, ... (`world_of(world_seed, count)`: the world and its questions; `write`:
    its corpus directory), each world indexed in its own corpus index and searched as the pipeline searches (its
    hits laid out in prompt order, `pipeline.prompt_order`)."""
    from hypic_rag.pipeline.answering import prompt_order
    from hypic_rag.retrieval.chunking import Chunker
    from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
    from hypic_rag.retrieval.embeddings import SentenceEmbedder
    from hypic_rag.retrieval.loading import load_corpus
    from hypic_rag.retrieval.manifest import ModelIdentity
    from hypic_rag.runtime.model import tokenizer_digest

    embedder = SentenceEmbedder()
    identity = ModelIdentity(path="heldout-eval", fingerprint="heldout-eval", tokenizer_fingerprint=tokenizer_digest(tokenizer))
    chunker = chunker or Chunker(tokenizer)
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        produced, world_seed = 0, seed
        while produced < num_questions:
            world, questions = world_of(world_seed, min(questions_per_world, num_questions - produced))
            documents_dir = write(world, questions, Path(scratch) / f"world-{world_seed}")
            index_dir = Path(scratch) / f"index-{world_seed}"
            with CorpusIndex.open_for_update(index_dir, embedder, IndexConfig(model=identity, chunker=chunker.config,
                                                                                  retrieval=retrieval)) as index:
                index.ingest(load_corpus(documents_dir), chunker)
                for question in questions:
                    hits = prompt_order(index.search(question.text, k=num_chunks, hop_slots=hop_slots))
                    yield RetrievedCase(
                        world,
                        question,
                        [hit.chunk.text for hit in hits],
                        [list(hit.chunk.token_ids) for hit in hits],
                        [Path(hit.chunk.doc_id).stem for hit in hits],
                        [float(hit.score) for hit in hits],
                        [hit.hop_query is not None for hit in hits],
                        [hit.chunk.position for hit in hits],
                    )
                    produced += 1
            world_seed += 1
