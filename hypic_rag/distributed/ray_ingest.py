"""Loading, chunking and embedding as Ray tasks, feeding the index's single writer in corpus order.

The index stays written by one process (the driver): SQLite and FAISS have one writer, and the order documents are
stored in decides their vector ids. What is spread over the cluster is the work before the write:

- loading: the corpus's files are read and parsed (PDF, HTML, DOCX) by tasks of `FILES_PER_TASK` files, and their
  documents and skips come back in file order (`loading.load_corpus(load_files=...)`), so the loaded corpus is the
  one a local load gives;
- chunking: every changed document is cut by a task (the chunker, tokenizer included, shipped once through the
  object store), up to `LOOKAHEAD_DOCUMENTS` documents ahead of the writer;
- embedding: the writer embeds the new chunks of consecutive documents in batches of `embed_batch_chunks`
  (`CorpusIndex.ingest_steps`); `IngestFeeder` predicts those batches from the chunks that came back, with the
  same rule, and embeds them on tasks ahead of the writer. A batch the writer asks for is matched by its exact
  texts, so a wrong prediction costs time, never a different vector: the embedder sees the same batches as in
  a local run, and the vectors are the same.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hypic_rag.retrieval.chunk_context import contextualised
from hypic_rag.retrieval.chunking import Chunk, Chunker
from hypic_rag.retrieval.loading import Document, SkippedInput, load_file

if TYPE_CHECKING:
    from hypic_rag.retrieval.corpus_index import CorpusIndex
    from hypic_rag.retrieval.loading import LoadedCorpus

logger = logging.getLogger(__name__)

FILES_PER_TASK = 32
"""Corpus files read by one loading task."""
DOCUMENTS_PER_TASK = 16
"""Documents cut by one chunking task."""
LOOKAHEAD_DOCUMENTS = 512
"""Changed documents whose chunking (and then embedding) may run ahead of the writer: bounds the driver's memory."""
EMBED_TASKS_AHEAD = 4
"""Embedding batches that may be in flight ahead of the writer."""

_EMBEDDERS: dict[tuple[str | None, int], Any] = {}
"""Per worker process: the embedder of each (path, batch size), loaded once (Ray reuses worker processes)."""


# ==================================================================================================== tasks
def _load_files_task(files: list[tuple[str, str]]) -> list[tuple[list[Document], list[SkippedInput]]]:
    return [load_file(Path(path), relative) for path, relative in files]


def _chunk_task(chunker: Chunker, documents: list[Document]) -> list[list[Chunk]]:
    return [[chunk for chunk in chunker.chunk_steps(document) if chunk is not None] for document in documents]


def _embed_task(embedder_path: str | None, batch_size: int, texts: list[str]) -> np.ndarray:
    from hypic_rag.retrieval.embeddings import SentenceEmbedder

    key = (embedder_path, batch_size)
    if key not in _EMBEDDERS:
        import torch

        torch.set_num_threads(1)
        _EMBEDDERS[key] = SentenceEmbedder(embedder_path, batch_size=batch_size)
    return _EMBEDDERS[key].embed(texts)


def _remote(ray: Any, function: Any) -> Any:
    return ray.remote(num_cpus=1, max_retries=2)(function)


# ==================================================================================================== loading
class RayFileLoader:
    """A `loading.FileLoader` reading files in Ray tasks of `files_per_task`, results in file order."""

    def __init__(self, ray: Any, files_per_task: int = FILES_PER_TASK) -> None:
        if files_per_task < 1:
            raise ValueError(f"files_per_task must be positive, got {files_per_task}")
        self.ray = ray
        self.files_per_task = files_per_task

    def __call__(self, files: Sequence[tuple[Path, str]]) -> Iterator[tuple[list[Document], list[SkippedInput]]]:
        task = _remote(self.ray, _load_files_task)
        refs = [task.remote([(str(path), relative) for path, relative in files[start : start + self.files_per_task]])
                for start in range(0, len(files), self.files_per_task)]
        for ref in refs:
            yield from self.ray.get(ref)


# ==================================================================================================== ingest
def _texts_key(texts: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest())
    return digest.hexdigest()


class IngestFeeder:
    """`cut` and `embed` for `CorpusIndex.ingest` (one run over `corpus`): chunks and vectors computed by Ray tasks,
    chunking up to `lookahead` documents and embedding up to `embed_ahead` batches ahead of the writer.

    Build it on the index opened for update, before `ingest` (it reads which documents changed and which chunk ids
    each holds, as `ingest` does)."""

    def __init__(
        self, ray: Any, index: CorpusIndex, corpus: LoadedCorpus, chunker: Chunker, *,
        lookahead: int = LOOKAHEAD_DOCUMENTS, documents_per_task: int = DOCUMENTS_PER_TASK,
        embed_ahead: int = EMBED_TASKS_AHEAD,
    ) -> None:
        self.ray = ray
        self.index = index
        self.lookahead = max(1, lookahead)
        self.documents_per_task = max(1, documents_per_task)
        self.embed_ahead = max(1, embed_ahead)
        self.embed_batch_chunks = index.embed_batch_chunks
        embedder = index.embedder
        self._embedder_args = (embedder.source_path, embedder.batch_size)
        self._dimension = embedder.dimension
        stored = index.docstore.document_digests()
        self._changed = [document for document in corpus.documents
                         if stored.get(document.doc_id, (None, None))[0] != document.content_sha256]
        self._documents = {document.doc_id: document for document in self._changed}
        self._embedding_context = index.manifest.retrieval_settings.embedding_context
        self._chunk_task = _remote(ray, _chunk_task)
        self._embed_task = _remote(ray, _embed_task)
        self._chunker_ref = ray.put(chunker) if self._changed else None
        self._chunk_refs: deque[tuple[Any, list[str]]] = deque()  # (ref, doc ids), in corpus order
        self._next_to_submit = 0
        self._handed = 0
        self._chunks: dict[str, list[Chunk]] = {}  # doc id -> chunks, fetched, not yet handed to the writer
        self._predict_order: deque[str] = deque()  # fetched doc ids not yet counted into a predicted batch
        self._pending_texts: list[str] = []
        self._pending_chunks = 0
        self._predicted: deque[tuple[str, Any]] = deque()  # (texts key, ref) of predicted batches, in order
        self._unsubmitted: deque[tuple[str, list[str]]] = deque()  # predicted batches waiting for room
        self.embed_batches = 0
        self.mispredicted = 0

    @property
    def changed_documents(self) -> int:
        return len(self._changed)

    # ------------------------------------------------------------------------------------------- chunking
    def _submit_chunking(self, upto: int) -> None:
        """Submit chunking tasks for the changed documents before position `upto`."""
        upto = min(upto, len(self._changed))
        while self._next_to_submit < upto:
            group = self._changed[self._next_to_submit : self._next_to_submit + self.documents_per_task]
            self._chunk_refs.append((self._chunk_task.remote(self._chunker_ref, group), [d.doc_id for d in group]))
            self._next_to_submit += len(group)

    def _fetch_next_group(self) -> None:
        ref, doc_ids = self._chunk_refs.popleft()
        for doc_id, chunks in zip(doc_ids, self.ray.get(ref), strict=True):
            self._chunks[doc_id] = chunks
            self._predict_order.append(doc_id)
        self._predict()

    def cut(self, document: Document) -> list[Chunk]:
        """The chunks of `document` (one of the corpus's changed documents, asked for in corpus order)."""
        self._handed += 1
        self._submit_chunking(self._handed + self.lookahead)
        while document.doc_id not in self._chunks:
            if not self._chunk_refs:  # not a document this feeder planned for: cut it now, the same way
                return self.ray.get(self._chunk_task.remote(self._chunker_ref, [document]))[0]
            self._fetch_next_group()
        while self._chunk_refs and self._ready(self._chunk_refs[0][0]):  # take what is done, to embed ahead
            self._fetch_next_group()
        return self._chunks.pop(document.doc_id)

    def _ready(self, ref: Any) -> bool:
        done, _ = self.ray.wait([ref], timeout=0)
        return bool(done)

    # ------------------------------------------------------------------------------------------- embedding
    def _predict(self) -> None:
        """Count fetched documents into predicted embedding batches (the writer's rule: a batch closes once its
        documents' new chunks reach `embed_batch_chunks`; the last one at the corpus's end)."""
        while self._predict_order:
            doc_id = self._predict_order.popleft()
            known = self.index.docstore.chunk_ids_of(doc_id)  # read before the writer replaces this document
            keyed, texts = contextualised(self._documents[doc_id], self._chunks.get(doc_id, []),
                                          self._embedding_context)  # the ids and texts the writer embeds
            new = [text for chunk, text in zip(keyed, texts) if chunk.chunk_id not in known]
            self._pending_texts.extend(new)
            self._pending_chunks += len(new)
            if self._pending_chunks >= self.embed_batch_chunks:
                self._close_batch()
        if self._next_to_submit >= len(self._changed) and not self._chunk_refs and self._pending_texts:
            self._close_batch()  # every document counted: the rest is the last batch
        self._submit_embeddings()

    def _close_batch(self) -> None:
        texts, self._pending_texts, self._pending_chunks = self._pending_texts, [], 0
        if texts:
            self._unsubmitted.append((_texts_key(texts), texts))

    def _submit_embeddings(self) -> None:
        while self._unsubmitted and len(self._predicted) < self.embed_ahead:
            key, texts = self._unsubmitted.popleft()
            self._predicted.append((key, self._embed_task.remote(*self._embedder_args, texts)))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of one batch of new chunks' texts, [len(texts), dimension] float32: the predicted batch's when it
        is this one, else computed now (the same way)."""
        if not texts:
            return np.zeros((0, self._dimension), dtype=np.float32)
        self.embed_batches += 1
        key = _texts_key(texts)
        while self._predicted or self._unsubmitted:
            if not self._predicted:
                self._submit_embeddings()
            predicted_key, ref = self._predicted.popleft()
            self._submit_embeddings()
            if predicted_key == key:
                return np.ascontiguousarray(self.ray.get(ref), dtype=np.float32)
            self.ray.cancel(ref)
            self.mispredicted += 1
            logger.debug("embedding batch predicted out of step with the writer; dropped one")
        self.mispredicted += 1
        return np.ascontiguousarray(self.ray.get(self._embed_task.remote(*self._embedder_args, list(texts))),
                                    dtype=np.float32)
