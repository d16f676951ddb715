"""Held-out QA cases whose context comes from the real retriever (FAISS + the shipped MiniLM embedder).

Each held-out world is written out as a corpus, indexed with `hypic_rag.retrieval` exactly as a user's corpus is
(chunker, docstore, FAISS), and each question's k chunks are the top-k hits for the question text, best first.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

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

    @property
    def gold_retrieved(self) -> bool:
        """Whether every gold document is among the retrieved chunks."""
        return set(self.question.gold_doc_ids) <= set(self.retrieved_doc_ids)


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
) -> Iterator[RetrievedCase]:
    """Held-out cases of worlds `seed`, `seed + 1`, ... (the same questions as `evaluate.heldout_cases`), each
    world indexed in its own corpus index under `work_dir` (a temporary directory by default) and searched as the
    product's pipeline searches it (`hop_slots` of the k places from one retrieval hop)."""
    from hypic_rag.retrieval.chunking import Chunker
    from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexSettings
    from hypic_rag.retrieval.embeddings import SentenceEmbedder
    from hypic_rag.retrieval.loading import load_corpus
    from hypic_rag.retrieval.manifest import ModelIdentity
    from hypic_rag.runtime.model import tokenizer_digest

    embedder = SentenceEmbedder()
    identity = ModelIdentity(path="heldout-eval", fingerprint="heldout-eval", tokenizer_fingerprint=tokenizer_digest(tokenizer))
    chunker = Chunker(tokenizer)
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        produced, world_seed = 0, seed
        while produced < num_questions:
            world = generate_world(world_seed)
            count = min(questions_per_world, num_questions - produced)
            questions = generate_questions(world, world_seed, count, two_hop_share=two_hop_share)
            documents_dir = write_corpus(world, questions, Path(scratch) / f"world-{world_seed}")
            index_dir = Path(scratch) / f"index-{world_seed}"
            with CorpusIndex.open_for_update(index_dir, embedder, IndexSettings(model=identity)) as index:
                index.ingest(load_corpus(documents_dir), chunker)
                for question in questions:
                    hits = index.search(question.text, k=num_chunks, hop_slots=hop_slots)
                    yield RetrievedCase(
                        world,
                        question,
                        [hit.chunk.text for hit in hits],
                        [list(hit.chunk.token_ids) for hit in hits],
                        [Path(hit.chunk.doc_id).stem for hit in hits],
                        [float(hit.score) for hit in hits],
                        [hit.hop_query is not None for hit in hits],
                    )
                    produced += 1
            world_seed += 1
