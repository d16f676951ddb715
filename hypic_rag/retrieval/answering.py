"""Answer a question over a precomputed index: retrieve, compose cached chunk states, generate.

The prompt is laid out as `hypic_rag/prompt.py` says: the prefix segment, then each retrieved chunk as its own
segment (best match first, using the token ids stored at precompute, never re-tokenized), then the question.
Chunk entries come from the index's segment cache; a miss (another mode's seam width, an evicted entry) is encoded
and stored on the way.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from hypic_rag.prompt import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.chunking import encode_segment_text
from hypic_rag.retrieval.corpus_index import CorpusIndex, SearchHit
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.errors import RetrievalError
from hypic_rag.retrieval.manifest import IndexManifest, ModelIdentity

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AskOptions:
    """top_k: chunks retrieved. mode: a runtime mode (`hypic` uses the precomputed entries). model_path: None
    uses the model recorded in the manifest. embedder_path: None uses the manifest's (or the shipped default)."""

    top_k: int = 4
    mode: str = "hypic"
    max_new_tokens: int = 32
    model_path: Path | None = None
    embedder_path: Path | None = None
    device: str | None = None
    prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be positive, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")


@dataclass(frozen=True, slots=True)
class Answer:
    """The generated answer, the chunks it was given, and where the time went (seconds)."""

    text: str
    sources: list[SearchHit]
    timings: dict[str, float]
    cache_hits: int
    cache_misses: int
    recomputed_tokens: int
    prompt_tokens: int
    finish_reason: str = ""


class IndexAnswerer:
    """Holds an opened index, model, cache and engine, to answer several questions."""

    def __init__(self, index_dir: str | Path, options: AskOptions | None = None) -> None:
        from hypic_rag.cache.segment_cache import SegmentCache
        from hypic_rag.runtime.engine import Engine
        from hypic_rag.runtime.model import load_model

        self.options = options or AskOptions()
        index_dir = Path(index_dir).expanduser().resolve()
        manifest = IndexManifest.load(index_dir)
        model_path = self.options.model_path or Path(manifest.model.path)
        if not Path(model_path).is_dir():
            raise RetrievalError(f"model directory {str(model_path)!r} (recorded by the index) does not exist; pass --model")
        self.model = load_model(model_path, device=self.options.device)
        if self.model.tokenizer is None:
            raise RetrievalError(f"model {model_path} has no tokenizer")
        manifest.check_model(ModelIdentity(str(model_path), self.model.fingerprint, self.model.tokenizer_fingerprint))
        if self.options.prompt_format.chunk_template != manifest.chunk_template:
            raise RetrievalError("the prompt format's chunk template differs from the one the index was built with")
        embedder_path = self.options.embedder_path or manifest.embedder_path
        self.index = CorpusIndex.open(index_dir, SentenceEmbedder(embedder_path))
        self.cache = SegmentCache.open(self.index.cache_dir)
        self.engine = Engine(self.model, seam_tokens=manifest.seam_tokens, segment_cache=self.cache)

    def ask(self, question: str) -> Answer:
        """Retrieve the top-k chunks for `question`, compose their cached states and generate the answer."""
        from hypic_rag.runtime.engine import SamplingParams
        from hypic_rag.runtime.request import Request

        if not question.strip():
            raise RetrievalError("the question is empty")
        began = time.perf_counter()
        hits = self.index.search(question, self.options.top_k)
        retrieval_seconds = time.perf_counter() - began
        if not hits:
            raise RetrievalError("the index holds no chunks; run precompute first")
        prompt_format = self.options.prompt_format
        tokenizer = self.model.tokenizer
        request = Request(
            prefix_ids=encode_segment_text(tokenizer, prompt_format.prefix) if prompt_format.prefix else [],
            chunk_ids=[list(hit.chunk.token_ids) for hit in hits],
            question_ids=encode_segment_text(tokenizer, prompt_format.question(question)),
            chunk_labels=[f"{hit.chunk.doc_id}#{hit.chunk.position}" for hit in hits],
        )
        params = SamplingParams(
            max_new_tokens=self.options.max_new_tokens,
            stop_strings=(prompt_format.answer_stop,) if prompt_format.answer_stop else (),
        )
        generation = self.engine.generate(request, mode=self.options.mode, params=params)
        stats = generation.prefill
        timings = {
            "retrieval": retrieval_seconds,
            "cache_load": stats.load_seconds,
            "encode": stats.encode_seconds,
            "compose": stats.compose_seconds,
            "prefill": stats.prefill_seconds,
            "time_to_first_token": retrieval_seconds + generation.time_to_first_token,
            "total": time.perf_counter() - began,
        }
        return Answer(
            text=generation.text.strip(),
            sources=hits,
            timings=timings,
            cache_hits=stats.cache_hits,
            cache_misses=stats.cache_misses,
            recomputed_tokens=stats.recomputed_tokens,
            prompt_tokens=stats.prompt_tokens,
            finish_reason=generation.finish_reason,
        )

    def close(self) -> None:
        self.cache.close()
        self.index.close()

    def __enter__(self) -> IndexAnswerer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
