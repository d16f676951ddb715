"""What the model worker runs: answers, completions, document updates and cache statistics over one index.

A `ServiceBackend` is built and used by the worker thread only (see `worker.py`). It is a `RagPipeline` over the
index and the `ModelSession` the index was built for (model, engine, segment cache, the index's prompt format),
plus what only the service does (document jobs, limits). Retrieved chunks and completion segments reach the engine
as separate segments (their own token ids), never as one concatenated string, so each one's cached entry is reused
wherever it lands in a prompt.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypic_rag.pipeline.answering import RagPipeline
from hypic_rag.prompting.layout import tokenize_segment
from hypic_rag.prompting.matching import NO_MATCHING, MatchConfig, SegmentedPrompt
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.get_or_encode import FillReport
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SEED_MAX, SamplingParams
from hypic_rag.runtime.scheduler import CallbackSink, SchedulerConfig
from hypic_rag.server.events import TextEvent
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.errors import BadRequestError, ConflictError, NotFoundError, PayloadTooLargeError
from hypic_rag.server.deferred import Deferred
from hypic_rag.server.jobs import Job, JobRegistry
from hypic_rag.server.task_context import TaskContext
from hypic_rag.pipeline.session import CacheConfig, ModelSession
from hypic_rag.pipeline.usage import usage_of

logger = logging.getLogger(__name__)

API_SOURCE_ROOT = "<hypic-rag api>"
"""The `source_root` recorded for documents added through the API (precompute never deletes them)."""
INGEST_BATCH_DOCUMENTS = 16
"""Documents indexed per ingest batch (searchable together, once the batch is saved)."""
INGEST_STEP_CHUNKS = 32
"""Chunks cut or embedded in one step of a document job (the most a request waits for, with one chunk's encoding)."""


def check_segment_count(segments: Sequence[str], limit: int) -> None:
    """413 when a completion prompt has more separated parts (the query included) than the server accepts."""
    if len(segments) > limit:
        raise PayloadTooLargeError(
            f"prompt has {len(segments)} separated segments (the query included); this server accepts at most "
            f"{limit} per request (merge segments, or raise --max-segments)",
            param="prompt",
        )


@dataclass(frozen=True, slots=True)
class NewDocument:
    """A document sent to `POST /v1/documents`."""

    doc_id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionResult:
    """A finished completion: text, why it stopped, token accounting and timings (seconds)."""

    text: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    logprobs: list[dict[str, Any]] | None = None
    """Per generated token when asked: {"token", "bytes", "logprob", "top": [{"token", "bytes", "logprob"}]}."""


PromptBuilder = Callable[[ModelSession], Request | SegmentedPrompt]
"""Builds one prompt's request (or a `SegmentedPrompt`, which says which segments were matched) in the worker
thread (which owns the tokenizer and the matcher); ValueError for bad input (400)."""


class TokenCounter:
    """Counts a text's tokens from any thread: its own copy of the model's tokenizer, used under a lock (the
    worker's tokenizer belongs to the worker thread). Fast tokenizers release the GIL while counting."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()

    def count(self, text: str) -> int:
        """Tokens of `text` tokenized on its own, without special tokens."""
        with self._lock:
            return len(tokenize_segment(self._tokenizer, text))


class ServiceBackend:
    """An opened index, its model, engine and segment cache. Not thread-safe: the worker thread owns it."""

    def __init__(self, pipeline: RagPipeline, *, config: ServerConfig, writable: bool, chunker: Any | None) -> None:
        self.pipeline = pipeline
        self.config = config
        self.writable = writable
        self.chunker = chunker
        self.model_name = config.model_name or Path(str(pipeline.index.manifest.model.path)).name or "hypic-rag"
        self.counts = pipeline.index.counts()
        session = pipeline.session
        # the seams whose entries this index holds (its own, its default policy's): what a request's recompute
        # policy may read (`validation.checked_recompute_policy`)
        self.entry_seams = frozenset({session.seam_tokens, session.recompute_policy.chunk_seam(session.seam_tokens)})
        pipeline.session.set_matching(
            MatchConfig(enabled=config.match_segments, max_segments=config.max_segments)
        )
        if config.match_segments:
            known = pipeline.session.know_chunks(pipeline.index.docstore.iter_chunk_texts())
            logger.info("segment matching: %d of %d indexed chunks can be found in prompts", known, self.counts.chunks)
        self.token_counter = TokenCounter(pipeline.session.tokenizer)
        self.cache_snapshot: dict[str, Any] = {}
        self.miss_encoder: Any = None  # where cache misses are encoded (`ServerConfig.miss_encoders`), closed with us
        self.refresh_cache_snapshot()
        # the model's one scheduler (the pipeline's too), with the server's limits; the model worker drives its
        # steps (max_waiting None: the worker bounds the queue itself, --queue-size)
        self.scheduler = session.configure_scheduler(SchedulerConfig(
            max_running=config.max_running, step_tokens=config.step_tokens, max_waiting=None,
        ))
        self.index_lock = threading.RLock()
        """Held by whoever uses the index: the retrieval stage's batches, the worker's control tasks and job steps."""
        self._joined_texts: list[str] = []  # chunks a reader followed in, for the matcher (`know_joined_chunks`)

    # ------------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, config: ServerConfig) -> ServiceBackend:
        """Open the index (as its writer unless `config.read_only`), its model and its segment cache.

        Raises IndexNotFoundError / IndexCorruptError for a missing or unreadable manifest, IndexMismatchError when
        the index was built for another model (or tokenizer), RetrievalError when another process holds the
        index's writer lock, ModelLoadError for a model directory that cannot load (or has no tokenizer)."""
        from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
        from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
        from hypic_rag.retrieval.embeddings import SentenceEmbedder
        from hypic_rag.retrieval.manifest import IndexManifest, ModelIdentity

        index_dir = config.index_dir.resolve()
        manifest = IndexManifest.load(index_dir)
        # best effort: a damaged cache is disabled (warned), a failed write is logged; the service goes on
        cache = CacheConfig(best_effort=True, hot_budget_bytes=config.hot_cache_bytes, remote=config.remote_cache,
                             cache_format=config.cache_format)
        session = ModelSession.for_index(
            manifest, index_dir, model_path=config.model_path, device=config.device, dtype=config.dtype, cache=cache,
            recompute_policy=config.recompute_policy,
            cache_dir=config.cache_dir,
        )
        chunker = None
        try:
            embedder = SentenceEmbedder(manifest.embedder_path)
            if config.read_only:
                index = CorpusIndex.open(index_dir, embedder)
            else:
                chunker_config = ChunkerConfig(
                    chunk_tokens=int(manifest.chunker["chunk_tokens"]),
                    paragraph_fill=float(manifest.chunker.get("paragraph_fill", ChunkerConfig().paragraph_fill)),
                )
                settings = IndexConfig(
                    model=ModelIdentity.of(session.model_path, session.model),
                    chunker=chunker_config,
                    prompt_format=session.prompt_format,
                    seam_tokens=manifest.seam_tokens,
                )
                index = CorpusIndex.open_for_update(index_dir, embedder, settings)
                chunker = Chunker(session.tokenizer, chunker_config, session.prompt_format)
        except BaseException:
            session.close()
            raise
        try:
            pipeline = RagPipeline(index, session, hop_slots=config.hop_slots,
                                   max_question_chars=config.max_question_chars)
        except BaseException:
            session.close()
            index.close()
            raise
        logger.info(
            "serving %s (%d documents, %d chunks) with %s%s",
            index_dir, pipeline.index.counts().documents, pipeline.index.counts().chunks, session.model_path,
            " read-only" if config.read_only else "",
        )
        backend = cls(pipeline, config=config, writable=not config.read_only, chunker=chunker)
        try:
            if config.miss_encoders is not None:
                backend.miss_encoder = config.miss_encoders(session.engine, session.model_path)
                session.engine.miss_encoder = backend.miss_encoder
            backend.warm_up()
        except BaseException:
            backend.close()
            raise
        return backend

    def warm_up(self) -> None:
        """Load the embedder and make sure the prompt prefix's cache entry exists, so the first request pays for
        neither (an index built before the engine's current entry layout may lack it)."""
        self.pipeline.index.embedder.embed_query("warm-up")
        session = self.pipeline.session
        if session.fill_cache(session.plan(include_prefix=True)).cache_misses:
            logger.info("encoded the prompt prefix's cache entry (missing from the index's cache)")
        self.refresh_cache_snapshot()

    def close(self) -> None:
        """Close the cache (flushing pending access notes), the index and the miss encoder's actors."""
        try:
            self.pipeline.close()
        finally:
            if self.miss_encoder is not None:
                self.miss_encoder.close()

    def follow_index_writer(self) -> None:
        """(Any thread) A read-only backend catches up with the documents another process (the index's owner:
        `serve --workers N` over a writable index) committed since the last call (`CorpusIndex.follow_writer`): its
        retrieval then finds every document indexed, and none deleted, before this call (docs/service.md,
        "Workers", says the consistency rule). The joined chunks' texts wait for the matcher, which belongs to the
        worker thread (`know_joined_chunks`). A writable backend makes the changes itself: nothing to do."""
        if self.writable:
            return
        with self.index_lock:
            joined = self.pipeline.index.follow_writer()
            if joined is None:
                return
            self.counts = self.pipeline.index.counts()
            if self.config.match_segments:
                self._joined_texts.extend(chunk.text for chunk in joined)

    def know_joined_chunks(self) -> None:
        """(The worker thread) Follow the index's writer, then let the matcher find the chunks that joined."""
        self.follow_index_writer()
        with self.index_lock:
            texts, self._joined_texts = self._joined_texts, []
        if texts:
            self.pipeline.session.know_chunks(texts)

    @property
    def cache(self) -> Any:
        """The session's segment source: the index's `SegmentCache`, opened in `open`."""
        return self.pipeline.session.segment_source

    def refresh_cache_snapshot(self) -> dict[str, Any]:
        """Read the cache's counters (cheap) into `cache_snapshot`, which other threads may read."""
        self.cache_snapshot = self.cache.stats()
        return self.cache_snapshot

    # ------------------------------------------------------------------------------------------- answering
    def complete_choices(
        self, prompts: Sequence[PromptBuilder], *, n: int, mode: str, params: SamplingParams, context: TaskContext,
        param: str = "prompt",
    ) -> Deferred[list[CompletionResult]]:
        """`n` completions of each prompt (choice `i * n + j` is prompt i's j-th), generated together in the
        scheduler; the list arrives in the returned `Deferred`.

        Each prompt's request is built here, all before any is generated (a builder's ValueError is a 400 naming
        `param`). With a seed, choice k samples with seed + k (so the choices differ yet repeat). Events:
        `TextEvent(delta, choice=k)`. A choice that fails stops the others.
        """
        session = self.pipeline.session
        self.know_joined_chunks()  # a reader's matcher finds the documents the owner indexed before this request
        vocab = self.vocab_size
        bad = [token for token in params.logit_bias if not 0 <= token < vocab]
        if bad:
            raise BadRequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                  param="logit_bias")
        built: list[tuple[Request, float, SegmentedPrompt | None]] = []
        for build in prompts:
            began = time.perf_counter()
            try:
                prompt = build(session)
            except ValueError as error:
                raise BadRequestError(f"{param}: {error}", param=param) from None
            request = prompt.request if isinstance(prompt, SegmentedPrompt) else prompt
            matched = prompt if isinstance(prompt, SegmentedPrompt) else None
            check_segment_count(request.segments + [request.question_ids], self.config.max_segments)
            if any(not 0 <= token < vocab for token in request.all_ids()):
                raise BadRequestError(f"{param}: token ids must lie in 0..{vocab - 1}", param=param)
            if request.prompt_tokens > self.config.max_prompt_tokens:
                raise PayloadTooLargeError(
                    f"the prompt has {request.prompt_tokens} tokens; this server accepts at most "
                    f"{self.config.max_prompt_tokens}",
                    param=param,
                )
            built.append((request, time.perf_counter() - began, matched))
        choices: list[Deferred[CompletionResult]] = []
        sequences: list[Any] = []
        for number, (request, tokenized, matched) in enumerate(built):
            for choice in range(n):
                index = number * n + choice
                seed = None if params.seed is None else (params.seed + index) % (SEED_MAX + 1)
                result, sequence = self._generate(request, mode, dataclasses.replace(params, seed=seed), context,
                                                  index, tokenized, matched)
                choices.append(result)
                sequences.append(sequence)
        return Deferred.gather(choices, on_reject=lambda: [sequence.cancel() for sequence in sequences])

    @property
    def vocab_size(self) -> int:
        """Token ids this model takes: 0 .. vocab_size - 1."""
        config = self.pipeline.session.model.config
        return int(getattr(getattr(config, "text_config", None) or config, "vocab_size"))

    def _generate(self, request: Request, mode: str, params: SamplingParams, context: TaskContext,
                  index: int, tokenized: float,
                  matched: SegmentedPrompt | None = None) -> tuple[Deferred[CompletionResult], Any]:
        began = time.perf_counter()
        result: Deferred[CompletionResult] = Deferred()

        def on_token(_: int, delta: str) -> None:
            if delta:
                context.emit(TextEvent(delta, index))

        def on_finish(generation: Generation) -> None:
            self.refresh_cache_snapshot()
            timings = dict(generation.timings)
            timings["tokenize"] = tokenized
            timings["time_to_first_token"] = tokenized + generation.time_to_first_token
            timings["total"] = tokenized + time.perf_counter() - began
            logprobs = None if generation.logprobs is None else [
                {**self._token_text(item.token_id), "logprob": item.logprob,
                 "top": [{**self._token_text(token), "logprob": value} for token, value in item.top]}
                for item in generation.logprobs
            ]
            usage = usage_of(generation)
            usage["segments"] = len(request.segments) + 1
            usage.update(NO_MATCHING if matched is None else
                         matched.matching_usage(generation.prefill.segment_reused_tokens))
            result.resolve(CompletionResult(generation.text, generation.finish_reason, usage, timings, logprobs))

        sink = CallbackSink(on_token, on_finish, result.reject)
        sequence = self.scheduler.submit(request, mode, params, sink=sink, check=context.check)
        return result, sequence

    def _token_text(self, token_id: int) -> dict[str, Any]:
        text = self.pipeline.session.tokenizer.decode([token_id])
        return {"token": text, "bytes": list(text.encode("utf-8", "replace"))}

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (special tokens kept), for `echo`."""
        return str(self.pipeline.session.tokenizer.decode(list(token_ids)))

    # ------------------------------------------------------------------------------------------- documents
    def add_documents(self, documents: Sequence[NewDocument], job: Job, jobs: JobRegistry) -> Iterator[None]:
        """A background job in bounded steps: index the documents (`INGEST_BATCH_DOCUMENTS` at a time), then
        encode each of their chunks missing from the cache.

        One step (one `next`) cuts or embeds at most `INGEST_STEP_CHUNKS` chunks, stores one document (its own
        docstore transaction), saves the FAISS index after a batch, or encodes one chunk, so a request waits for
        at most one step whatever the documents' sizes. Every write commits on its own, so a job stopped between
        steps leaves index and cache consistent. A document is searchable once its batch is saved; its chunks'
        cache entries follow (a query before then encodes the missing entries itself).
        """
        from hypic_rag.retrieval.loading import Document, LoadedCorpus

        self._require_writable()
        index = self.pipeline.index
        totals = {"documents_added": 0, "documents_updated": 0, "documents_unchanged": 0, "chunks_added": 0}
        segments: list[tuple[int, ...]] = []
        for start in range(0, len(documents), INGEST_BATCH_DOCUMENTS):
            batch = [
                Document(doc_id=item.doc_id, text=item.text, source=f"api:{item.doc_id}", metadata=dict(item.metadata))
                for item in documents[start : start + INGEST_BATCH_DOCUMENTS]
            ]
            steps = index.ingest_steps(
                LoadedCorpus(Path(API_SOURCE_ROOT), batch, []), self.chunker, delete_missing=False,
                step_chunks=INGEST_STEP_CHUNKS,
            )
            report = yield from steps  # a document counts as indexed once its batch is saved (searchable)
            totals["documents_added"] += report.documents_added
            totals["documents_updated"] += report.documents_updated
            totals["documents_unchanged"] += report.documents_unchanged
            totals["chunks_added"] += report.chunks_added
            for document in batch:
                segments.extend(index.docstore.token_ids_of(document.doc_id))
                if self.config.match_segments:
                    self.pipeline.session.know_chunks(index.docstore.iter_chunk_texts(document.doc_id))
            self.counts = index.counts()
            jobs.update(job, documents_indexed=start + len(batch))
            yield
        unique = list(dict.fromkeys(segments))
        # one chunk encoded and stored per step (`ModelSession.fill_steps`; its first step is the lookup)
        fill = self.pipeline.session.fill_steps(self.pipeline.session.plan(unique, include_prefix=False),
                                                commit_entries=1)
        progress = next(fill)
        jobs.update(job, chunks_total=len(unique), chunks_encoded=progress.cache_hits)
        yield
        report = yield from self._encoding_steps(fill, job, jobs)
        self.refresh_cache_snapshot()
        return {**totals, "chunks_encoded": report.encoded, "chunks_already_cached": report.cache_hits}

    def _encoding_steps(self, fill: Generator[FillReport, None, FillReport], job: Job,
                        jobs: JobRegistry) -> Generator[None, None, FillReport]:
        """Run a fill's encoding steps as job steps, recording the progress after each."""
        while True:
            try:
                progress = next(fill)
            except StopIteration as done:
                return done.value
            jobs.update(job, chunks_encoded=progress.cache_hits + progress.encoded)
            self.refresh_cache_snapshot()
            yield

    def delete_document(self, doc_id: str) -> int:
        """Remove a document and its chunks from the index; returns how many chunks went.

        Cache entries stay: they are keyed by content, may serve other documents, and age out under the budget.
        """
        self._require_writable()
        index = self.pipeline.index
        if doc_id not in index.docstore.document_digests():
            raise NotFoundError(f"no document with id {doc_id!r}", param="doc_id")
        removed = index.delete_document(doc_id)
        self.counts = index.counts()
        return removed

    def _require_writable(self) -> None:
        if not self.writable:
            raise ConflictError("the server opened its index read-only (--read-only); documents cannot be changed")
