"""A searchable corpus index in one directory: manifest, SQLite docstore and FAISS vectors.

Layout of an index directory:
    manifest.json     what built the index and what it holds (`manifest.py`)
    docstore.sqlite   documents and chunks: text, token ids, embeddings, metadata (`docstore.py`)
    vectors.faiss     FAISS inner-product index keyed by the chunks' vector ids (`faiss_index.py`)
    segment_cache/    the segment cache of every chunk (default place; written by precompute)
    index.lock        held while a writer has the index open

`ingest` brings the index in line with a loaded corpus without a rebuild: unchanged documents (same content
digest) are skipped, changed ones are re-chunked and only their new chunks embedded, documents gone from the same
corpus root are deleted (documents are keyed by id, so a moved corpus is recognised and its root updated). Every document is committed in its own transaction; the FAISS index is then synced to
the docstore, so an interrupted ingest resumes where it stopped and no chunk is ever indexed twice. A change (an
ingest, a delete) commits the docstore, then writes `vectors.faiss`, then the manifest; a process killed between
two of these leaves them disagreeing, and the next writer to open the index writes the repair back at once
(`_write_back_repairs`); a reader repairs its own copy in memory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
from tqdm import tqdm

from hypic_rag.cache.errors import free_space_note
from hypic_rag.demo.world import CorpusFit
from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.entry.compression import DEFAULT_CACHE_FORMAT, cache_format
from hypic_rag.utils.paths import unusable_directory_reason
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.chunking import Chunk, Chunker, ChunkerConfig
from hypic_rag.retrieval.docstore import DocStore, DocStoreCounts, StoredChunk
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.errors import (
    IndexCorruptError,
    IndexLocationError,
    IndexLockedError,
    IndexWriteError,
    RetrievalError,
)
from hypic_rag.retrieval.faiss_index import SyncResult, VectorIndex, VectorIndexConfig
from hypic_rag.retrieval.loading import Document, LoadedCorpus, SkippedInput
from hypic_rag.retrieval.manifest import MANIFEST_FILE, IndexManifest, ModelIdentity
from hypic_rag.retrieval.multi_hop import hop_candidates, hop_shortlist, merge_hop_hits, rank_hop_candidates
from hypic_rag.utils.streaming import drain

logger = logging.getLogger(__name__)

DOCSTORE_FILE = "docstore.sqlite"
VECTORS_FILE = "vectors.faiss"
LOCK_FILE = "index.lock"
DEFAULT_CACHE_DIR = "segment_cache"
DEFAULT_EMBED_BATCH_CHUNKS = 256


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """What a writer asks of an index; an existing index must have been built the same way.

    vector_index: None keeps an existing index's FAISS kind (flat for a new one). cache_dir: None puts the
    segment cache in `<index>/segment_cache`. embed_batch_chunks: new chunks embedded per batch. cache_format: the
    cache format a new index records (an existing one keeps its own until precompute rebuilds its cache in another:
    `CorpusIndex.record_cache_format`).
    """

    model: ModelIdentity
    chunker: ChunkerConfig = field(default_factory=ChunkerConfig)
    prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT
    seam_tokens: int = 8
    vector_index: VectorIndexConfig | None = None
    cache_dir: Path | None = None
    embed_batch_chunks: int = DEFAULT_EMBED_BATCH_CHUNKS
    cache_format: str = DEFAULT_CACHE_FORMAT

    def __post_init__(self) -> None:
        check_seam_tokens(self.seam_tokens)
        cache_format(self.cache_format)
        if self.embed_batch_chunks < 1:
            raise ValueError(f"embed_batch_chunks must be positive, got {self.embed_batch_chunks}")


@dataclass(frozen=True, slots=True)
class IngestReport:
    """What one ingest changed."""

    documents_added: int = 0
    documents_updated: int = 0
    documents_unchanged: int = 0
    documents_deleted: int = 0
    chunks_added: int = 0
    chunks_removed: int = 0
    skipped: tuple[SkippedInput, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.documents_added or self.documents_updated or self.documents_deleted)


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One retrieved chunk and its cosine similarity to the query.

    hop_query: for a chunk found by the retrieval hop, the follow-up query that found it (None for a direct hit);
    hop_score: its similarity to that query (its `score` stays its similarity to the question).
    """

    score: float
    chunk: StoredChunk
    hop_query: str | None = None
    hop_score: float | None = None


@dataclass(slots=True)
class _PendingDocument:
    document: Document
    chunks: list[Chunk]
    new_chunks: list[Chunk]
    existed: bool


def _relative_cache_dir(index_dir: Path, cache_dir: Path | None) -> str:
    if cache_dir is None:
        return DEFAULT_CACHE_DIR
    resolved = cache_dir.expanduser().resolve()
    try:
        return resolved.relative_to(index_dir.resolve()).as_posix()
    except ValueError:
        return str(resolved)


def check_index_location(index_dir: Path) -> None:
    """Refuse an index path that is, or would be created in, a file or an unwritable place (nothing is created)."""
    reason = unusable_directory_reason(index_dir)
    if reason is not None:
        raise IndexLocationError(f"index directory unusable: {reason}; pass another --index")


def _acquire_lock(index_dir: Path) -> IO[str]:
    try:
        handle = (index_dir / LOCK_FILE).open("a+")
    except OSError as error:
        raise IndexLocationError(f"cannot write {index_dir / LOCK_FILE}: {error.strerror}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise IndexLockedError(f"index {str(index_dir)!r} is being written by another process") from None
    return handle


def check_not_locked(directory: str | Path) -> None:
    """RetrievalError when another process holds the index's writer lock (checked now, not kept: a caller that
    goes on to `open_for_update` may still lose a race, and gets the same error then)."""
    _acquire_lock(Path(directory).expanduser().resolve()).close()


def record_cache_format_choice(directory: str | Path, record: dict[str, Any] | None) -> IndexManifest:
    """Record `record` (a format calibration, `hypic_rag.calibration.cache_format.FormatChoice.to_dict()` and how it was
    made; None clears it) as the index's recommended cache format, under the index's writer lock; the index's own
    format does not change (precompute rebuilds the cache in another). `IndexLockedError` when another process
    writes the index."""
    directory = Path(directory).expanduser().resolve()
    lock = _acquire_lock(directory)
    try:
        manifest = IndexManifest.load(directory)
        manifest.cache_format_choice = None if record is None else dict(record)
        manifest.__post_init__()  # checks the recorded format name
        manifest.save(directory)
        return manifest
    finally:
        lock.close()


def record_recompute_policy(directory: str | Path, record: dict[str, Any] | None) -> IndexManifest:
    """Record `record` (a calibration, `hypic_rag.calibration.policy.Calibration.to_dict()` and how it was made;
    None clears it) as the index's recompute policy, under the index's writer lock; the manifest saved.
    `IndexLockedError` when another process writes the index."""
    directory = Path(directory).expanduser().resolve()
    lock = _acquire_lock(directory)
    try:
        manifest = IndexManifest.load(directory)
        manifest.recompute_policy = None if record is None else dict(record)
        manifest.__post_init__()  # checks the recorded spec
        manifest.save(directory)
        return manifest
    finally:
        lock.close()


def _open_docstore(directory: Path) -> DocStore:
    """The index's docstore; an unreadable file (or an unwritable index directory) as a one-line error."""
    path = directory / DOCSTORE_FILE
    try:
        return DocStore(path)
    except (sqlite3.Error, RetrievalError) as error:  # DocStore reports SQLite's failures as RetrievalErrors
        if not os.access(directory, os.W_OK | os.X_OK):
            raise IndexLocationError(
                f"cannot open {path}: index directory {directory} is not writable (SQLite writes its journal there)"
            ) from None
        if isinstance(error, RetrievalError):
            raise
        raise IndexCorruptError(f"cannot read {path}: {error} (delete the index directory and run precompute again)") from None


class CorpusIndex:
    """An index directory opened for search (`open`) or for updates (`open_for_update`)."""

    def __init__(
        self, directory: Path, manifest: IndexManifest, docstore: DocStore, vectors: VectorIndex,
        embedder: SentenceEmbedder, lock: IO[str] | None = None,
    ) -> None:
        self.directory = directory
        self.manifest = manifest
        self.docstore = docstore
        self.vectors = vectors
        self.embedder = embedder
        self._lock = lock
        self.embed_batch_chunks = DEFAULT_EMBED_BATCH_CHUNKS
        self._unsaved_changes = False
        self._seen_version = docstore.data_version()  # the docstore's commits this object has caught up with

    # -------------------------------------------------------------------------- opening
    @classmethod
    def open_for_update(cls, directory: str | Path, embedder: SentenceEmbedder, settings: IndexConfig) -> CorpusIndex:
        """Create the index, or open an existing one after checking it was built the same way."""
        directory = Path(directory).expanduser().resolve()
        check_index_location(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise IndexLocationError(f"cannot create index directory {directory}: {error.strerror}") from None
        lock = _acquire_lock(directory)
        try:
            chunker_settings = settings.chunker.to_dict()
            template = settings.prompt_format.chunk_template
            if (directory / MANIFEST_FILE).exists():
                manifest = IndexManifest.load(directory)
                manifest.check_embedder(embedder.identity)
                adopted = manifest.adopt_model(settings.model)
                manifest.check_chunking(chunker_settings, template, settings.seam_tokens)
                manifest.check_prompt_format(settings.prompt_format)
                if settings.vector_index is not None:
                    manifest.check_vector_index(settings.vector_index)
                if adopted:
                    manifest.save(directory)
            else:
                manifest = IndexManifest(
                    embedder=embedder.identity,
                    model=settings.model,
                    chunker=chunker_settings,
                    prompt_format=settings.prompt_format,
                    seam_tokens=settings.seam_tokens,
                    vector_index=settings.vector_index or VectorIndexConfig(),
                    cache_dir=_relative_cache_dir(directory, settings.cache_dir),
                    embedder_path=embedder.source_path,
                    cache_format=settings.cache_format,
                )
                manifest.save(directory)
            index = cls._assemble(directory, manifest, embedder, lock)
        except BaseException:
            lock.close()
            raise
        try:
            index._write_back_repairs()
        except BaseException:
            index.close()
            raise
        index.embed_batch_chunks = settings.embed_batch_chunks
        return index

    @classmethod
    def open(
        cls, directory: str | Path, embedder: SentenceEmbedder | None = None, *, embedder_path: str | Path | None = None
    ) -> CorpusIndex:
        """Open an existing index for search.

        embedder: the one it was built with; None loads it (from `embedder_path` if given, else from the path the
        manifest recorded, else the shipped default). Another embedder raises IndexMismatchError.
        """
        directory = Path(directory).expanduser().resolve()
        manifest = IndexManifest.load(directory)
        if embedder is None:
            embedder = SentenceEmbedder(embedder_path if embedder_path is not None else manifest.embedder_path)
        manifest.check_embedder(embedder.identity)
        return cls._assemble(directory, manifest, embedder, lock=None)

    @classmethod
    def _assemble(
        cls, directory: Path, manifest: IndexManifest, embedder: SentenceEmbedder, lock: IO[str] | None
    ) -> CorpusIndex:
        docstore = _open_docstore(directory)
        try:
            vectors = VectorIndex.load(directory / VECTORS_FILE, manifest.embedder.dimension, manifest.vector_index)
        except (RuntimeError, ValueError) as error:
            docstore.close()
            raise IndexCorruptError(f"cannot read {directory / VECTORS_FILE}: {error}") from error
        index = cls(directory, manifest, docstore, vectors, embedder, lock)
        repaired = index.sync_vectors()
        # an HNSW file keeps removed vectors (tombstones are rebuilt on open, not stored): those are no repair
        if repaired.added or (repaired.removed and vectors.config.kind != "hnsw"):
            index._unsaved_changes = True
            logger.warning(
                "FAISS index was behind the docstore (interrupted run?): added %d, removed %d vectors",
                repaired.added,
                repaired.removed,
            )
        return index

    def _write_back_repairs(self) -> None:
        """Write what opening repaired back to disk (the writer's job: a reader repairs in memory only).

        A change commits to the docstore first, then writes the FAISS file, then the manifest's counts; a kill
        between two of these leaves the files disagreeing (a deleted document's vectors still in `vectors.faiss`,
        stale counts). Opening syncs the vectors to the docstore in memory (`_assemble`); here a writer saves them
        and the counts at once, so the files agree again even if nothing else is ever written."""
        counts = self.docstore.counts()
        fresh = {"documents": counts.documents, "chunks": counts.chunks, "tokens": counts.tokens}
        if not self._unsaved_changes and self.manifest.counts == fresh:
            return
        repaired_vectors = self._unsaved_changes
        self.save()
        logger.warning("index %s was left half-saved (interrupted run?): %s written back", self.directory,
                       "its FAISS file and counts" if repaired_vectors else "its counts")

    # -------------------------------------------------------------------------- updates
    def _check_chunker(self, chunker: Chunker) -> None:
        self.manifest.check_chunking(
            chunker.config.to_dict(), chunker.prompt_format.chunk_template, self.manifest.seam_tokens
        )

    def ingest(
        self, corpus: LoadedCorpus, chunker: Chunker, *, delete_missing: bool = True, show_progress: bool = False,
        cut: Callable[[Document], list[Chunk]] | None = None, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
    ) -> IngestReport:
        """Bring the index in line with `corpus` (see the module docstring) and save it if anything changed.

        cut / embed: where a changed document's chunks and a batch of new chunks' vectors come from (None: this
        process's `chunker` and embedder). Given (Ray tasks, `distributed.ray_ingest`), they must return what
        those would: the documents are still stored here, in corpus order, one transaction each."""
        return drain(self.ingest_steps(corpus, chunker, delete_missing=delete_missing, show_progress=show_progress,
                                       cut=cut, embed=embed))

    def ingest_steps(
        self, corpus: LoadedCorpus, chunker: Chunker, *, delete_missing: bool = True, show_progress: bool = False,
        step_chunks: int | None = None, cut: Callable[[Document], list[Chunk]] | None = None,
        embed: Callable[[Sequence[str]], np.ndarray] | None = None,
    ) -> Generator[int, None, IngestReport]:
        """`ingest` as a generator of bounded steps, for callers that interleave other work between them (the
        service's document jobs); its return value is the report.

        With `step_chunks`, each `next` does one piece of work: cutting up to `step_chunks` chunks, embedding up to
        `step_chunks` chunks, storing one document (its own transaction, so bounded by the document's size), or the
        final save. Each yield says how many of the corpus's documents are done (stored or found unchanged).
        Without it, the steps are whole batches of `embed_batch_chunks` new chunks (what `ingest` does). Closed
        between steps, the index holds the documents stored so far and stays consistent (the FAISS file catches
        up with the docstore on the next save or open). `cut` and `embed`: as in `ingest`.
        """
        if step_chunks is not None and step_chunks < 1:
            raise ValueError(f"step_chunks must be positive, got {step_chunks}")
        self._require_writer()
        self._check_chunker(chunker)
        stored = self.docstore.document_digests()
        source_root = str(corpus.root)
        counts = {"added": 0, "updated": 0, "unchanged": 0, "chunks_added": 0, "chunks_removed": 0}
        pending: list[_PendingDocument] = []
        pending_chunks = 0
        moved: list[str] = []
        done = 0
        for document in tqdm(corpus.documents, desc="indexing", unit="doc", disable=not show_progress):
            digest, root = stored.get(document.doc_id, (None, None))
            if digest == document.content_sha256:
                counts["unchanged"] += 1
                done += 1
                if root != source_root:
                    moved.append(document.doc_id)
                continue
            chunks: list[Chunk] = [] if cut is None else cut(document)
            for number, chunk in enumerate(chunker.chunk_steps(document) if cut is None else (), 1):
                if chunk is not None:
                    chunks.append(chunk)
                if step_chunks is not None and number % step_chunks == 0:
                    yield done
            stored_chunk_ids = self.docstore.chunk_ids_of(document.doc_id)
            new_chunks = [chunk for chunk in chunks if chunk.chunk_id not in stored_chunk_ids]
            pending.append(_PendingDocument(document, chunks, new_chunks, document.doc_id in stored))
            pending_chunks += len(new_chunks)
            if pending_chunks >= self.embed_batch_chunks:
                done = yield from self._commit_steps(pending, source_root, counts, step_chunks, done, embed)
                pending, pending_chunks = [], 0
        done = yield from self._commit_steps(pending, source_root, counts, step_chunks, done, embed)
        if moved:
            self.docstore.move_documents(moved, source_root)
        deleted = 0
        if delete_missing:
            present = {document.doc_id for document in corpus.documents}
            for doc_id in self.docstore.document_ids_from_root(source_root):
                if doc_id not in present:
                    counts["chunks_removed"] += self.docstore.delete_document(doc_id)
                    deleted += 1
                    self._unsaved_changes = True
        if self._unsaved_changes:
            self.save()
        report = IngestReport(
            documents_added=counts["added"],
            documents_updated=counts["updated"],
            documents_unchanged=counts["unchanged"],
            documents_deleted=deleted,
            chunks_added=counts["chunks_added"],
            chunks_removed=counts["chunks_removed"],
            skipped=tuple(corpus.skipped),
        )
        logger.info("ingest: %s", report)
        return report

    def _commit_steps(
        self, pending: list[_PendingDocument], source_root: str, counts: dict[str, int], step_chunks: int | None,
        done: int, embed: Callable[[Sequence[str]], np.ndarray] | None = None,
    ) -> Generator[int, None, int]:
        """Embed the pending documents' new chunks (`step_chunks` at a time, or all at once, with `embed` when
        given) and store each document in its own transaction; yields and returns the number of documents done."""
        if not pending:
            return done
        new_chunks = [chunk for item in pending for chunk in item.new_chunks]
        texts = [chunk.text for chunk in new_chunks]
        if step_chunks is None:
            vectors = (embed or self.embedder.embed)(texts)
        else:
            parts = []
            for start in range(0, len(texts), step_chunks):
                parts.append(self.embedder.embed(texts[start : start + step_chunks]))
                yield done
            vectors = np.concatenate(parts) if parts else self.embedder.embed([])
        embeddings = {chunk.chunk_id: vector for chunk, vector in zip(new_chunks, vectors, strict=True)}
        for item in pending:
            added, removed = self.docstore.replace_document(item.document, source_root, item.chunks, embeddings)
            self._unsaved_changes = True
            counts["updated" if item.existed else "added"] += 1
            counts["chunks_added"] += added
            counts["chunks_removed"] += removed
            done += 1
            yield done
        return done

    def delete_document(self, doc_id: str) -> int:
        """Remove one document and its chunks from the index; returns how many chunks went."""
        self._require_writer()
        removed = self.docstore.delete_document(doc_id)
        self.save()
        return removed

    def follow_writer(self) -> list[StoredChunk] | None:
        """For an index opened for search (`open`) while another process writes it (the owner of a writable
        `serve --workers N`, a `precompute`): catch up with what the writer committed to the docstore since the
        last call. The in-memory FAISS index is synced to the docstore (as opening does), so the next search sees
        every document committed before this call and none deleted before it. Returns the chunks that joined
        (empty: only deletions), or None when nothing was committed meanwhile (one `PRAGMA data_version`, the
        common case). The FAISS file is not read: the docstore is the truth, and its commits are atomic."""
        version = self.docstore.data_version()  # read first: a commit during the sync is caught by the next call
        if version == self._seen_version:
            return None
        live = self.docstore.live_vector_ids()
        joined = live[~np.isin(live, self.vectors.stored_ids())]
        result = self.sync_vectors()
        self._seen_version = version
        logger.info("index %s followed its writer: %d chunks joined, %d left", self.directory, result.added,
                    result.removed)
        return self.docstore.chunks(joined.tolist()) if len(joined) else []

    def sync_vectors(self) -> SyncResult:
        """Make the FAISS index hold exactly the docstore's chunks."""
        return self.vectors.sync(self.docstore.live_vector_ids(), self.docstore.embeddings)

    def save(self) -> None:
        """Sync and write the FAISS index, then the manifest with fresh counts."""
        self._require_writer()
        self.sync_vectors()
        try:
            self.vectors.save(self.directory / VECTORS_FILE)
            counts = self.docstore.counts()
            self.manifest.counts = {"documents": counts.documents, "chunks": counts.chunks, "tokens": counts.tokens}
            self.manifest.save(self.directory)
        except (OSError, RuntimeError) as error:  # disk full; FAISS says so in a RuntimeError
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise IndexWriteError(
                f"cannot write the index in {self.directory}: {reason.splitlines()[-1].rsplit(' failed: ', 1)[-1]}"
                f"{free_space_note(self.directory)}; the files written before are intact"
            ) from None
        self._unsaved_changes = False

    def record_cache_format(self, name: str) -> None:
        """Record that the index's cache entries are now stored in format `name` (precompute, once it has rebuilt
        every planned entry in it); the manifest saved."""
        self._require_writer()
        cache_format(name)
        self.manifest.cache_format = name
        self.manifest.save(self.directory)

    def record_bundled_model_fit(self, fit: CorpusFit | None) -> None:
        """Record how the chunks fit the bundled demo model's world (`hypic_rag.demo.world`; None: not measured,
        another model); the manifest saved when it changed."""
        self._require_writer()
        record = None if fit is None else fit.to_dict()
        if record != self.manifest.bundled_model_fit:
            self.manifest.bundled_model_fit = record
            self.manifest.save(self.directory)

    def _require_writer(self) -> None:
        if self._lock is None:
            raise RetrievalError("index was opened for search only; use CorpusIndex.open_for_update to change it")

    # --------------------------------------------------------------------------- reading
    @property
    def cache_dir(self) -> Path:
        return self.manifest.cache_path(self.directory)

    def counts(self) -> DocStoreCounts:
        return self.docstore.counts()

    def search(self, query: str, k: int = 4, *, hop_slots: int = 0) -> list[SearchHit]:
        """The k chunks most similar to `query`, best first (k is capped at the chunks the index holds, so a huge
        k costs no more than the whole index).

        hop_slots > 0 (and < k): the last `hop_slots` places go to chunks found by one retrieval hop, one follow-up
        query per place built from the best hit's sentences (see `multi_hop`), for questions whose second document
        shares no words with the question; places the hop cannot fill keep the direct hits. A hop's hits carry
        the follow-up query (`hop_query`) and their similarity to it (`hop_score`); every hit's `score` is its
        similarity to `query`. One query is `search_many` of one."""
        return self.search_many([query], [k], hop_slots=hop_slots)[0]

    def search_many(self, queries: Sequence[str], ks: Sequence[int], *, hop_slots: int = 0) -> list[list[SearchHit]]:
        """`search(queries[i], ks[i], hop_slots=hop_slots)` for every i, batched: the queries are embedded in one
        call and searched together (one FAISS search per distinct k), and so are the hop's follow-up queries of all
        of them. Each query gets the hits it gets alone (batching changes only how the work is grouped)."""
        if hop_slots < 0:
            raise ValueError("hop_slots must be >= 0")
        if len(ks) != len(queries):
            raise ValueError(f"{len(queries)} queries but {len(ks)} values of k")
        for k in ks:
            if k < 1:
                raise ValueError(f"k must be positive, got {k}")
        capped = [min(k, len(self.vectors)) for k in ks]
        if not queries or max(capped) == 0:
            return [[] for _ in queries]
        query_vectors = self.embedder.embed(list(queries))
        direct = self._search_vectors(query_vectors, capped)
        hopping = [number for number, k in enumerate(capped) if 0 < hop_slots < k and direct[number]]
        candidates = {  # only those that may be chosen are embedded (`hop_shortlist`)
            number: hop_shortlist(queries[number], hop_candidates(queries[number], direct[number][0].chunk.text),
                                  hop_slots)
            for number in hopping
        }
        hopping = [number for number in hopping if candidates[number]]
        if not hopping:
            return direct
        follow_vectors = self.embedder.embed([follow for number in hopping for _, follow in candidates[number]])
        follows: dict[int, list[tuple[str, np.ndarray]]] = {}
        offset = 0
        for number in hopping:
            count = len(candidates[number])
            follows[number] = rank_hop_candidates(queries[number], query_vectors[number], candidates[number],
                                                  follow_vectors[offset : offset + count], hop_slots)
            offset += count
        searched = [(number, follow, vector) for number in hopping for follow, vector in follows[number]]
        found = self._search_vectors(np.stack([vector for _, _, vector in searched]),
                                     [capped[number] for number, _, _ in searched])
        hops: dict[int, list[list[SearchHit]]] = {number: [] for number in hopping}
        for (number, follow, _), hits in zip(searched, found):
            hops[number].append([SearchHit(hit.score, hit.chunk, follow, hit.score) for hit in hits])
        results = list(direct)
        for number in hopping:
            merged = merge_hop_hits(direct[number], hops[number], capped[number], hop_slots,
                                    key=lambda hit: hit.chunk.vector_id)
            results[number] = self._scored_against(merged, query_vectors[number])
        return results

    def _scored_against(self, hits: list[SearchHit], query_vector: np.ndarray) -> list[SearchHit]:
        """`hits` with each hop hit's `score` made its cosine similarity to the question ([d] `query_vector`)."""
        hop_ids = [hit.chunk.vector_id for hit in hits if hit.hop_query is not None]
        if not hop_ids:
            return hits
        similarity = dict(zip(hop_ids, (self.docstore.embeddings(hop_ids) @ query_vector).tolist()))
        return [
            hit if hit.hop_query is None else SearchHit(float(similarity[hit.chunk.vector_id]), hit.chunk,
                                                        hit.hop_query, hit.hop_score)
            for hit in hits
        ]

    def _search_vectors(self, vectors: np.ndarray, ks: Sequence[int]) -> list[list[SearchHit]]:
        """The top `ks[i]` hits of `vectors[i]` ([n, d]) for every i: one FAISS search per distinct k, the chunks
        of every hit read in one docstore query."""
        found: list[list[tuple[float, int]]] = [[] for _ in ks]
        for k in sorted(set(ks)):
            rows = [number for number, wanted in enumerate(ks) if wanted == k]
            scores, ids = self.vectors.search(vectors[rows], k)
            for row, row_scores, row_ids in zip(rows, scores, ids):
                found[row] = [(float(score), int(vector_id)) for score, vector_id in zip(row_scores, row_ids)
                              if vector_id >= 0]
        wanted_ids = list(dict.fromkeys(vector_id for hits in found for _, vector_id in hits))
        chunks = {chunk.vector_id: chunk for chunk in self.docstore.chunks(wanted_ids)}
        return [[SearchHit(score, chunks[vector_id]) for score, vector_id in hits if vector_id in chunks]
                for hits in found]

    def close(self) -> None:
        self.docstore.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> CorpusIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

