"""`RayScaleOut`: precompute's loading, chunking and embedding as Ray tasks and its encoding on Ray actors
(`PrecomputeOptions.scale_out`; what `hypic-rag precompute --ray` passes).

    precompute(PrecomputeOptions(corpus=..., index_dir=..., model_path=..., scale_out=RayScaleOut("auto")))

The driver stays the index's single writer, and the cache's, unless a shared remote tier is given: then the
actors write their entries there themselves; see `ray_ingest` and `ray_encoder`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypic_rag.distributed.cluster import ClusterOptions, connect, encoder_slots
from hypic_rag.distributed.ray_encoder import RayEncoderPool
from hypic_rag.distributed.ray_ingest import IngestFeeder, RayFileLoader
from hypic_rag.retrieval.encoding_pool import EncoderSpec
from hypic_rag.retrieval.loading import LoadedCorpus, load_corpus

if TYPE_CHECKING:
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.retrieval.chunking import Chunker
    from hypic_rag.retrieval.corpus_index import CorpusIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RayScaleOut:
    """A `hypic_rag.pipeline.precompute.ScaleOut` on the Ray cluster at `address` ("local", "auto" or an address).

    actors: encoding actors (None: one per GPU of the cluster when the model runs on CUDA, else one per CPU slot).
    Connects on first use (`connect`: a missing Ray or an unreachable cluster is one `RayUnavailableError`)."""

    address: str = "local"
    actors: int | None = None

    def __post_init__(self) -> None:
        ClusterOptions(address=self.address)  # validates the address
        if self.actors is not None and self.actors < 1:
            raise ValueError(f"actors must be >= 1, got {self.actors}")

    def connect(self) -> Any:
        """`ray`, connected to this cluster."""
        return connect(ClusterOptions(address=self.address))

    def load_corpus(self, path: Path) -> LoadedCorpus:
        """The corpus loaded by Ray tasks (the same documents and skips, in the same order, as a local load)."""
        return load_corpus(path, load_files=RayFileLoader(self.connect()))

    def ingest_hooks(self, index: CorpusIndex, corpus: LoadedCorpus, chunker: Chunker) -> dict[str, Any]:
        """`cut` and `embed` for `CorpusIndex.ingest`: chunking and embedding on Ray tasks, ahead of the writer."""
        feeder = IngestFeeder(self.connect(), index, corpus, chunker)
        logger.info("%d changed documents to chunk and embed on Ray", feeder.changed_documents)
        return {"cut": feeder.cut, "embed": feeder.embed}

    def encoder(self, engine: Any, spec: EncoderSpec, *, remote: RemoteTierConfig | None = None,
                namespace: CacheNamespace | None = None) -> RayEncoderPool:
        """Encoding actors of `spec`'s model running `engine`'s batches (they start on first use); with `remote`
        and `namespace` (the cache's), each actor stores its entries in that remote tier itself."""
        ray = self.connect()
        gpu = spec.device.startswith("cuda")
        actors = self.actors or encoder_slots(ray, gpu=gpu)
        return RayEncoderPool(ray, spec, actors=actors, encode_batch_tokens=engine.encode_batch_tokens, gpu=gpu,
                              remote=remote, namespace=namespace)
