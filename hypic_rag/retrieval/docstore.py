"""The docstore: documents and their chunks (text, token ids, embedding, metadata) in one SQLite file.

A chunk's metadata is its document's metadata with the chunk's own fields over it (`page`, `page_end`,
`section`: where in the document it lies). Docstores made before chunks had metadata get the column (empty) when
opened; one that cannot be written is read without it.

SQLite in WAL mode gives crash-safe transactions: a document's chunks are replaced in one transaction, so a killed
precompute leaves every document either fully old or fully new. Each chunk row has a `vector_id`, its id in the
FAISS index, allocated with AUTOINCREMENT so an id is never reused after a delete. Embeddings are kept here too,
which lets the FAISS index be repaired or rebuilt without re-embedding.

SQLite errors leave as one-line retrieval errors naming the file: a file that is not a database or is damaged
raises `IndexCorruptError`; a failed write (disk full) raises `IndexWriteError`, after the transaction was rolled
back, so the stored documents stay as they were.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from hypic_rag.cache.errors import free_space_note
from hypic_rag.retrieval.chunking import Chunk
from hypic_rag.retrieval.errors import IndexCorruptError, IndexWriteError, RetrievalError
from hypic_rag.retrieval.loading import Document

_F = TypeVar("_F", bound=Callable[..., Any])

SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    doc_id TEXT PRIMARY KEY,
    source_root TEXT NOT NULL,
    source TEXT NOT NULL,
    content_sha256 TEXT NOT NULL,
    metadata TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS chunks (
    vector_id INTEGER PRIMARY KEY AUTOINCREMENT,
    chunk_id TEXT NOT NULL UNIQUE,
    doc_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    text TEXT NOT NULL,
    token_ids BLOB NOT NULL,
    n_tokens INTEGER NOT NULL,
    char_start INTEGER NOT NULL,
    char_end INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks (doc_id, position);
"""

TOKEN_DTYPE = np.dtype("<i4")
EMBEDDING_DTYPE = np.dtype("<f4")


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk as the docstore holds it, with its document's source, and its document's metadata with the chunk's
    own location fields (page, section) over it."""

    vector_id: int
    chunk_id: str
    doc_id: str
    position: int
    text: str
    token_ids: tuple[int, ...]
    source: str
    metadata: dict[str, Any]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class DocStoreCounts:
    """Documents, chunks and chunk tokens held; longest_chunk: the token count of the longest chunk."""

    documents: int
    chunks: int
    tokens: int
    longest_chunk: int = 0


def _token_blob(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=TOKEN_DTYPE).tobytes()


def _json(fields: dict[str, Any]) -> str:
    return json.dumps(fields, ensure_ascii=False, sort_keys=True)


def _tokens_from_blob(blob: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(blob, dtype=TOKEN_DTYPE).tolist())


def sqlite_failure(path: Path, error: sqlite3.Error) -> RetrievalError:
    """The one-line error for an SQLite failure on the docstore at `path`."""
    reason = str(error) or type(error).__name__
    if isinstance(error, sqlite3.OperationalError) and any(
        word in reason for word in ("full", "I/O", "readonly", "read-only", "unable to open")
    ):
        return IndexWriteError(f"cannot write {path}: {reason}{free_space_note(path)}; the index is as it was")
    return IndexCorruptError(f"cannot read {path}: {reason}; build the index again with `hypic-rag precompute` "
                             "into a new directory")


def _sqlite_errors(method: _F) -> _F:
    """Raise SQLite errors of `method` as `sqlite_failure` errors."""

    @functools.wraps(method)
    def wrapper(self: DocStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as error:
            raise sqlite_failure(self.path, error) from None

    return wrapper  # type: ignore[return-value]


class DocStore:
    """Documents and chunks of one index (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # one thread at a time, not always the opener's: the service's retrieval stage and model worker take
            # turns under `ServiceBackend.index_lock`
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise sqlite_failure(path, error) from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._chunk_metadata = self._chunk_metadata_column()
        except sqlite3.Error as error:
            self._db.close()
            raise sqlite_failure(path, error) from None
        self._chunk_select = (
            f"SELECT c.vector_id, c.chunk_id, c.doc_id, c.position, c.text, c.token_ids, d.source, d.metadata, "
            f"{self._chunk_metadata} FROM chunks c JOIN documents d ON d.doc_id = c.doc_id"
        )

    def _chunk_metadata_column(self) -> str:
        """The SQL of a chunk's metadata: its column, added to a docstore made before it when that can be written,
        else an empty object."""
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(chunks)")}
        if "metadata" in columns:
            return "c.metadata"
        try:
            self._db.execute("ALTER TABLE chunks ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}'")
        except sqlite3.OperationalError:  # read-only: chunks have no metadata of their own
            return "'{}'"
        return "c.metadata"

    def close(self) -> None:
        self._db.close()

    # ------------------------------------------------------------------------------- reads
    @_sqlite_errors
    def document_digests(self) -> dict[str, tuple[str, str]]:
        """doc_id -> (content digest, corpus root it was ingested from) of every stored document."""
        rows = self._db.execute("SELECT doc_id, content_sha256, source_root FROM documents")
        return {doc_id: (digest, root) for doc_id, digest, root in rows}

    @_sqlite_errors
    def document_ids_from_root(self, source_root: str) -> list[str]:
        """Ids of the documents ingested from one corpus root."""
        rows = self._db.execute("SELECT doc_id FROM documents WHERE source_root = ? ORDER BY doc_id", (source_root,))
        return [row[0] for row in rows]

    @_sqlite_errors
    def chunk_ids_of(self, doc_id: str) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT chunk_id FROM chunks WHERE doc_id = ?", (doc_id,))}

    @_sqlite_errors
    def token_ids_of(self, doc_id: str) -> list[tuple[int, ...]]:
        """The stored token ids of a document's chunks, in order (empty for an unknown document)."""
        rows = self._db.execute("SELECT token_ids FROM chunks WHERE doc_id = ? ORDER BY position", (doc_id,))
        return [_tokens_from_blob(row[0]) for row in rows]

    @_sqlite_errors
    def data_version(self) -> int:
        """SQLite's `PRAGMA data_version` on this connection: it changes whenever another connection (another
        process: the index's writer) has committed to the docstore since the last call, never for this
        connection's own commits. One cheap query: a reader polls it to see whether it must catch up."""
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    @_sqlite_errors
    def live_vector_ids(self) -> np.ndarray:
        rows = self._db.execute("SELECT vector_id FROM chunks ORDER BY vector_id").fetchall()
        return np.asarray([row[0] for row in rows], dtype=np.int64)

    @_sqlite_errors
    def embeddings(self, vector_ids: Iterable[int]) -> np.ndarray:
        """Stored embeddings of `vector_ids`, in that order."""
        ids = [int(i) for i in vector_ids]
        blobs = self._fetch_by_ids("SELECT vector_id, embedding FROM chunks WHERE vector_id IN ({})", ids)
        return np.stack([np.frombuffer(blobs[i], dtype=EMBEDDING_DTYPE) for i in ids]) if ids else np.zeros((0, 0))

    @_sqlite_errors
    def chunks(self, vector_ids: Iterable[int]) -> list[StoredChunk]:
        """Chunks by vector id, in the given order (ids no longer stored are left out)."""
        ids = [int(i) for i in vector_ids]
        query = self._chunk_select + " WHERE c.vector_id IN ({})"
        rows = self._fetch_by_ids(query, ids, whole_row=True)
        return [self._stored_chunk(rows[i]) for i in ids if i in rows]

    def iter_chunks(self) -> Iterator[StoredChunk]:
        """Every chunk, by document then position."""
        try:
            rows = self._db.execute(self._chunk_select + " ORDER BY c.doc_id, c.position")
            for row in rows:
                yield self._stored_chunk(row)
        except sqlite3.Error as error:
            raise sqlite_failure(self.path, error) from None

    def iter_chunk_texts(self, doc_id: str | None = None) -> Iterator[str]:
        """The text of every chunk (of one document when `doc_id` is given), by document then position."""
        where, args = ("WHERE doc_id = ? ", (doc_id,)) if doc_id is not None else ("", ())
        try:
            for (text,) in self._db.execute(f"SELECT text FROM chunks {where}ORDER BY doc_id, position", args):
                yield text
        except sqlite3.Error as error:
            raise sqlite_failure(self.path, error) from None

    @_sqlite_errors
    def document_list(self, offset: int = 0, limit: int = 100) -> list[tuple[str, str, int, int]]:
        """(doc_id, source, chunks, tokens) of at most `limit` documents by id, from the `offset`-th on."""
        rows = self._db.execute(
            "SELECT d.doc_id, d.source, COUNT(c.chunk_id), COALESCE(SUM(c.n_tokens), 0) FROM documents d "
            "LEFT JOIN chunks c ON c.doc_id = d.doc_id GROUP BY d.doc_id ORDER BY d.doc_id LIMIT ? OFFSET ?",
            (limit, offset))
        return [(str(doc_id), str(source), int(chunks), int(tokens)) for doc_id, source, chunks, tokens in rows]

    @_sqlite_errors
    def counts(self) -> DocStoreCounts:
        documents = self._db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]
        chunks, tokens, longest = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(n_tokens), 0), COALESCE(MAX(n_tokens), 0) FROM chunks").fetchone()
        return DocStoreCounts(documents=documents, chunks=chunks, tokens=tokens, longest_chunk=longest)

    def _fetch_by_ids(self, query: str, ids: list[int], whole_row: bool = False) -> dict[int, Any]:
        found: dict[int, Any] = {}
        for start in range(0, len(ids), 500):
            batch = ids[start : start + 500]
            for row in self._db.execute(query.format(",".join("?" * len(batch))), batch):
                found[row[0]] = row if whole_row else row[1]
        return found

    @staticmethod
    def _stored_chunk(row: tuple) -> StoredChunk:
        vector_id, chunk_id, doc_id, position, text, token_blob, source, metadata, chunk_metadata = row
        return StoredChunk(
            vector_id=vector_id,
            chunk_id=chunk_id,
            doc_id=doc_id,
            position=position,
            text=text,
            token_ids=_tokens_from_blob(token_blob),
            source=source,
            metadata={**json.loads(metadata), **json.loads(chunk_metadata)},
        )

    # ------------------------------------------------------------------------------ writes
    @_sqlite_errors
    def replace_document(
        self, document: Document, source_root: str, chunks: Sequence[Chunk], new_embeddings: dict[str, np.ndarray]
    ) -> tuple[int, int]:
        """Store `document` with exactly `chunks`, in one transaction.

        Chunks already stored (same chunk id) keep their row and vector id; `new_embeddings` must hold the
        embedding of every other chunk. Returns (chunks added, chunks removed).
        """
        kept = self.chunk_ids_of(document.doc_id)
        wanted = {chunk.chunk_id for chunk in chunks}
        missing = [c.chunk_id for c in chunks if c.chunk_id not in kept and c.chunk_id not in new_embeddings]
        if missing:
            raise ValueError(f"no embedding given for new chunks {missing[:3]} of {document.doc_id!r}")
        removed = kept - wanted
        with self._transaction():
            self._db.execute(
                "INSERT INTO documents (doc_id, source_root, source, content_sha256, metadata) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (doc_id) DO UPDATE SET source_root = excluded.source_root, source = excluded.source, "
                "content_sha256 = excluded.content_sha256, metadata = excluded.metadata",
                (
                    document.doc_id,
                    source_root,
                    document.source,
                    document.content_sha256,
                    _json(document.metadata),
                ),
            )
            self._db.executemany("DELETE FROM chunks WHERE chunk_id = ?", [(chunk_id,) for chunk_id in removed])
            for chunk in chunks:
                if chunk.chunk_id in kept:
                    self._db.execute(
                        "UPDATE chunks SET position = ?, char_start = ?, char_end = ?, metadata = ? WHERE chunk_id = ?",
                        (chunk.position, chunk.char_start, chunk.char_end, _json(chunk.metadata), chunk.chunk_id),
                    )
                    continue
                embedding = np.asarray(new_embeddings[chunk.chunk_id], dtype=EMBEDDING_DTYPE)
                self._db.execute(
                    "INSERT INTO chunks (chunk_id, doc_id, position, text, token_ids, n_tokens, char_start, char_end, "
                    "embedding, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        chunk.chunk_id,
                        chunk.doc_id,
                        chunk.position,
                        chunk.text,
                        _token_blob(chunk.token_ids),
                        chunk.n_tokens,
                        chunk.char_start,
                        chunk.char_end,
                        embedding.tobytes(),
                        _json(chunk.metadata),
                    ),
                )
        return len(wanted - kept), len(removed)

    @_sqlite_errors
    def move_documents(self, doc_ids: Sequence[str], source_root: str) -> None:
        """Record that unchanged documents now come from another corpus root (the corpus was moved)."""
        with self._transaction():
            self._db.executemany(
                "UPDATE documents SET source_root = ? WHERE doc_id = ?", [(source_root, doc_id) for doc_id in doc_ids]
            )

    @_sqlite_errors
    def delete_document(self, doc_id: str) -> int:
        """Remove a document and its chunks; returns how many chunks went."""
        with self._transaction():
            removed = self._db.execute("DELETE FROM chunks WHERE doc_id = ?", (doc_id,)).rowcount
            self._db.execute("DELETE FROM documents WHERE doc_id = ?", (doc_id,))
        return removed

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back if the block raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return
            except sqlite3.Error:
                self._rollback()
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self._db.in_transaction:  # SQLite rolls back by itself after some errors (disk full, I/O)
            self._db.execute("ROLLBACK")
