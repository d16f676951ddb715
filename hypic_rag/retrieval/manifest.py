"""The index manifest: what built an index and what it holds, in `manifest.json`.

It records the embedder identity (and the embedder's directory unless it is the shipped default), the chunker settings and chunk template (which decide the stored token ids),
the model and tokenizer fingerprints (which decide the cache entries), the seam width the cache was encoded with,
the FAISS settings, where the segment cache lives, and counts. Opening an index with another embedder, model,
tokenizer or chunker setting is refused with an `IndexMismatchError` that names the difference.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hypic_rag.retrieval.embeddings import EmbedderIdentity
from hypic_rag.retrieval.errors import IndexCorruptError, IndexMismatchError, IndexNotFoundError
from hypic_rag.retrieval.faiss_index import VectorIndexConfig

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The generation model an index's token ids and cache entries belong to."""

    path: str
    fingerprint: str
    tokenizer_fingerprint: str

    def __post_init__(self) -> None:
        if not self.fingerprint or not self.tokenizer_fingerprint:
            raise ValueError("model and tokenizer fingerprints must be non-empty")


@dataclass(slots=True)
class IndexManifest:
    """Contents of `manifest.json` (see the module docstring)."""

    embedder: EmbedderIdentity
    model: ModelIdentity
    chunker: dict[str, Any]
    chunk_template: str
    seam_tokens: int
    vector_index: VectorIndexConfig
    cache_dir: str
    embedder_path: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"documents": 0, "chunks": 0, "tokens": 0})
    format_version: int = MANIFEST_FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.seam_tokens < 0:
            raise ValueError(f"seam_tokens must be >= 0, got {self.seam_tokens}")
        if self.format_version != MANIFEST_FORMAT_VERSION:
            raise IndexMismatchError(
                f"index format version {self.format_version} is not supported (expected {MANIFEST_FORMAT_VERSION})"
            )

    def cache_path(self, index_dir: Path) -> Path:
        """The segment cache directory (stored relative to the index directory when inside it)."""
        return (index_dir / self.cache_dir).resolve()

    # ------------------------------------------------------------------------- compatibility
    def check_embedder(self, embedder: EmbedderIdentity) -> None:
        if embedder != self.embedder:
            raise IndexMismatchError(
                f"index was built with embedder {self.embedder.name} ({self.embedder.dimension} dims, digest "
                f"{self.embedder.digest[:12]}), not {embedder.name} ({embedder.dimension} dims, digest "
                f"{embedder.digest[:12]}); use the same embedder or a new index directory"
            )

    def check_model(self, model: ModelIdentity) -> None:
        if model.fingerprint != self.model.fingerprint:
            raise IndexMismatchError(
                f"index was built for model {self.model.path} (fingerprint {self.model.fingerprint[:12]}), not "
                f"{model.path} (fingerprint {model.fingerprint[:12]}); use that model or a new index directory"
            )
        if model.tokenizer_fingerprint != self.model.tokenizer_fingerprint:
            raise IndexMismatchError(
                f"index was built with another tokenizer (fingerprint {self.model.tokenizer_fingerprint[:12]}, "
                f"given {model.tokenizer_fingerprint[:12]}); use the same model or a new index directory"
            )

    def check_chunking(self, chunker: dict[str, Any], chunk_template: str, seam_tokens: int) -> None:
        if chunker != self.chunker:
            raise IndexMismatchError(
                f"index was built with chunker settings {self.chunker}, not {chunker}; pass the same "
                f"--chunk-tokens ({self.chunker.get('chunk_tokens')}) or use a new index directory"
            )
        if chunk_template != self.chunk_template:
            raise IndexMismatchError(f"index was built with chunk template {self.chunk_template!r}, not {chunk_template!r}")
        if seam_tokens != self.seam_tokens:
            raise IndexMismatchError(
                f"index cache was encoded with seam_tokens={self.seam_tokens}, not {seam_tokens}; "
                "use the same seam width or a new index directory"
            )

    def check_vector_index(self, config: VectorIndexConfig) -> None:
        if config.kind != self.vector_index.kind:
            raise IndexMismatchError(
                f"index uses a {self.vector_index.kind!r} FAISS index, not {config.kind!r}; use a new index directory"
            )

    # --------------------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["embedder"] = self.embedder.to_dict()
        data["vector_index"] = self.vector_index.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexManifest:
        return cls(
            embedder=EmbedderIdentity.from_dict(data["embedder"]),
            model=ModelIdentity(**data["model"]),
            chunker=dict(data["chunker"]),
            chunk_template=str(data["chunk_template"]),
            seam_tokens=int(data["seam_tokens"]),
            vector_index=VectorIndexConfig.from_dict(data["vector_index"]),
            cache_dir=str(data["cache_dir"]),
            embedder_path=data.get("embedder_path"),
            counts={key: int(value) for key, value in data["counts"].items()},
            format_version=int(data["format_version"]),
            created_at=float(data["created_at"]),
            updated_at=float(data["updated_at"]),
        )

    def save(self, index_dir: Path) -> None:
        """Write `manifest.json` atomically."""
        self.updated_at = time.time()
        path = index_dir / MANIFEST_FILE
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(temporary, path)

    @classmethod
    def load(cls, index_dir: Path) -> IndexManifest:
        """Read `manifest.json`; IndexNotFoundError when absent, IndexCorruptError when unreadable."""
        path = index_dir / MANIFEST_FILE
        if index_dir.exists() and not index_dir.is_dir():
            raise IndexNotFoundError(f"{str(index_dir)!r} is a file, not an index directory; run precompute first")
        if not path.is_file():
            raise IndexNotFoundError(f"{str(index_dir)!r} holds no index (no {MANIFEST_FILE}); run precompute first")
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise IndexCorruptError(f"cannot read {path}: {error}") from error
