"""FAISS inner-product index over normalised embeddings, keyed by the docstore's vector ids.

Kinds:
- `flat` (default): exact search, `IndexIDMap2(IndexFlatIP)`; vectors are removed in place.
- `hnsw`: approximate graph search, `IndexIDMap2(IndexHNSWFlat)`. HNSW cannot remove vectors, so removed ids
  become tombstones excluded from every search by an id selector; once tombstones pass `compact_fraction` of the
  stored vectors the graph is rebuilt from the live vectors.
- `ivf`: approximate inverted-file search, `IndexIVFFlat`, trained on the vectors present at the first sync
  (its list count is capped so every list gets about 40 training points); vectors are removed in place.

The docstore is the source of truth: `sync(live_ids, fetch_vectors)` makes the index hold exactly the live ids,
adding the missing ones and removing the rest. After a crash between a docstore commit and the index save, the
next open's sync repairs the index; nothing is ever indexed twice.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

logger = logging.getLogger(__name__)

VECTOR_INDEX_KINDS = ("flat", "hnsw", "ivf")
IVF_POINTS_PER_LIST = 40

FetchVectors = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True, slots=True)
class VectorIndexConfig:
    """Which FAISS index and its search settings.

    kind: `flat`, `hnsw` or `ivf`. hnsw_neighbors / hnsw_ef_search: HNSW graph degree and search breadth.
    ivf_lists / ivf_probe: most inverted lists, and lists visited per query. compact_fraction: HNSW tombstone
    share that triggers a rebuild from live vectors.
    """

    kind: str = "flat"
    hnsw_neighbors: int = 32
    hnsw_ef_search: int = 64
    ivf_lists: int = 256
    ivf_probe: int = 16
    compact_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.kind not in VECTOR_INDEX_KINDS:
            raise ValueError(f"vector index kind must be one of {VECTOR_INDEX_KINDS}, got {self.kind!r}")
        for name in ("hnsw_neighbors", "hnsw_ef_search", "ivf_lists", "ivf_probe"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 < self.compact_fraction <= 1.0:
            raise ValueError(f"compact_fraction must be in (0, 1], got {self.compact_fraction}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VectorIndexConfig:
        return cls(**data)


@dataclass(frozen=True, slots=True)
class SyncResult:
    """How many vectors a sync added and removed."""

    added: int
    removed: int


def _as_ids(ids: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))


def _as_vectors(vectors: Any, dimension: int) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(vectors, dtype=np.float32))
    if array.ndim != 2 or array.shape[1] != dimension:
        raise ValueError(f"expected vectors of shape [n, {dimension}], got {array.shape}")
    return array


class VectorIndex:
    """A FAISS index over (vector id, normalised embedding) pairs; see the module docstring."""

    def __init__(self, dimension: int, config: VectorIndexConfig, index: Any | None = None) -> None:
        if dimension < 1:
            raise ValueError(f"dimension must be positive, got {dimension}")
        self.dimension = dimension
        self.config = config
        self._index = index
        self._tombstones: set[int] = set()
        if index is not None and index.d != dimension:
            raise ValueError(f"stored FAISS index has dimension {index.d}, expected {dimension}")
        self._apply_search_settings()

    # ----------------------------------------------------------------- construction and persistence
    def _new_index(self, training_vectors: np.ndarray) -> Any:
        kind = self.config.kind
        if kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dimension))
        if kind == "hnsw":
            graph = faiss.IndexHNSWFlat(self.dimension, self.config.hnsw_neighbors, faiss.METRIC_INNER_PRODUCT)
            return faiss.IndexIDMap2(graph)
        lists = max(1, min(self.config.ivf_lists, len(training_vectors) // IVF_POINTS_PER_LIST))
        quantizer = faiss.IndexFlatIP(self.dimension)
        index = faiss.IndexIVFFlat(quantizer, self.dimension, lists, faiss.METRIC_INNER_PRODUCT)
        index.train(training_vectors)
        logger.info("trained IVF index: %d lists on %d vectors", lists, len(training_vectors))
        return index

    def _apply_search_settings(self) -> None:
        if self._index is None:
            return
        if self.config.kind == "ivf":
            self._index.nprobe = min(self.config.ivf_probe, self._index.nlist)
        elif self.config.kind == "hnsw":
            faiss.downcast_index(self._index.index).hnsw.efSearch = self.config.hnsw_ef_search

    @classmethod
    def load(cls, path: Path, dimension: int, config: VectorIndexConfig) -> VectorIndex:
        """Read an index written by `save` (or an empty one if the file does not exist yet)."""
        if not path.exists():
            return cls(dimension, config)
        return cls(dimension, config, faiss.read_index(str(path)))

    def save(self, path: Path) -> None:
        """Write the index atomically (temporary file, fsync, then rename).

        Serialised in memory and written by Python, not by `faiss.write_index`: FAISS only prints a failed close
        (a full disk shows there) and returns, which would rename a cut file over the good one.
        """
        if self._index is None:
            path.unlink(missing_ok=True)
            return
        temporary = path.with_name(path.name + ".tmp")
        try:
            with temporary.open("wb") as handle:
                handle.write(memoryview(faiss.serialize_index(self._index)))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except BaseException:  # disk full: leave the old file, and no partial temporary one
            temporary.unlink(missing_ok=True)
            raise

    # ----------------------------------------------------------------------------- contents
    def stored_ids(self) -> np.ndarray:
        """Every id held by the FAISS structure, tombstones included."""
        if self._index is None:
            return np.zeros(0, dtype=np.int64)
        if isinstance(self._index, faiss.IndexIDMap2):
            return faiss.vector_to_array(self._index.id_map).astype(np.int64)
        invlists = self._index.invlists
        parts = []
        for list_no in range(invlists.nlist):
            size = invlists.list_size(list_no)
            if size:
                parts.append(faiss.rev_swig_ptr(invlists.get_ids(list_no), size).copy())
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def live_ids(self) -> np.ndarray:
        """Ids that searches can return."""
        ids = self.stored_ids()
        if self._tombstones:
            ids = ids[~np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))]
        return ids

    def __len__(self) -> int:
        stored = 0 if self._index is None else int(self._index.ntotal)
        return stored - len(self._tombstones)

    # ------------------------------------------------------------------------------ updates
    def add(self, ids: Any, vectors: Any) -> None:
        """Add vectors under ids that the index does not hold yet."""
        ids, vectors = _as_ids(ids), _as_vectors(vectors, self.dimension)
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        if not len(ids):
            return
        if self._index is None:
            self._index = self._new_index(vectors)
            self._apply_search_settings()
        self._index.add_with_ids(vectors, ids)

    def remove(self, ids: Any) -> int:
        """Remove ids (HNSW: tombstone them). Returns how many were live."""
        ids = _as_ids(ids)
        if self._index is None or not len(ids):
            return 0
        if self.config.kind == "hnsw":
            present = set(self.stored_ids().tolist()) - self._tombstones
            removed = present.intersection(ids.tolist())
            self._tombstones |= removed
            return len(removed)
        return int(self._index.remove_ids(ids))

    def sync(self, live_ids: Any, fetch_vectors: FetchVectors) -> SyncResult:
        """Make the index hold exactly `live_ids`; `fetch_vectors(ids)` gives the vectors of missing ones."""
        live = _as_ids(live_ids)
        stored = self.stored_ids()
        extra = stored[~np.isin(stored, live)]
        if self.config.kind == "hnsw":
            tombstones = {int(i) for i in extra}
            removed = len(tombstones - self._tombstones)
            self._tombstones = tombstones
        else:
            removed = self.remove(extra)
        missing = live[~np.isin(live, stored)]
        if len(missing):
            self.add(missing, fetch_vectors(missing))
        if self.config.kind == "hnsw" and self._tombstones and (
            len(self._tombstones) > self.config.compact_fraction * self._index.ntotal
        ):
            self._compact(live, fetch_vectors)
        return SyncResult(added=len(missing), removed=removed)

    def _compact(self, live: np.ndarray, fetch_vectors: FetchVectors) -> None:
        """Rebuild an HNSW graph from the live vectors only."""
        logger.info("compacting HNSW index: %d tombstones of %d", len(self._tombstones), self._index.ntotal)
        self._index, self._tombstones = None, set()
        if len(live):
            self.add(live, fetch_vectors(live))

    # ------------------------------------------------------------------------------- search
    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k (scores, ids) per query, best first, each [len(queries), min(k, len(self))]: k is capped at the
        live vectors (a huge k allocates nothing more); results a search cannot fill (HNSW, IVF) have id -1."""
        queries = _as_vectors(queries, self.dimension)
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        k = min(k, len(self))
        if self._index is None or k == 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int64)
        params = None
        if self._tombstones:
            # FAISS keeps raw pointers: these locals keep the selectors alive through the search call
            excluded = faiss.IDSelectorBatch(np.fromiter(self._tombstones, dtype=np.int64))
            selector = faiss.IDSelectorNot(excluded)
            params = faiss.SearchParametersHNSW(sel=selector, efSearch=self.config.hnsw_ef_search)
        return self._index.search(queries, k, params=params)
