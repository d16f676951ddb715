"""The Ray side of `hypic-rag precompute --ray`: the encoder pool over the cluster (and, in `ray_ingest`, loading,
chunking and embedding as tasks). `retrieval.precompute` calls in here only when `PrecomputeOptions.ray` is set."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hypic_rag.distributed.cluster import connect, encoder_slots
from hypic_rag.distributed.ray_encoder import RayEncoderPool
from hypic_rag.distributed.ray_ingest import IngestFeeder, RayFileLoader
from hypic_rag.retrieval.encoding_pool import EncoderSpec
from hypic_rag.retrieval.loading import LoadedCorpus, load_corpus

if TYPE_CHECKING:
    from hypic_rag.retrieval.chunking import Chunker
    from hypic_rag.retrieval.corpus_index import CorpusIndex
    from hypic_rag.retrieval.precompute import PrecomputeOptions

logger = logging.getLogger(__name__)


def connect_for(options: PrecomputeOptions) -> Any:
    """`ray`, connected to `options.ray`'s cluster (`RayUnavailableError`, one line, when it cannot be)."""
    return connect(options.ray or "local")


def load_corpus_on_ray(options: PrecomputeOptions) -> LoadedCorpus:
    """`options.corpus` loaded by Ray tasks (the same documents and skips, in the same order, as a local load)."""
    return load_corpus(options.corpus, load_files=RayFileLoader(connect_for(options)))


def ingest_hooks(index: CorpusIndex, corpus: LoadedCorpus, chunker: Chunker) -> dict[str, Any]:
    """`cut` and `embed` for `CorpusIndex.ingest`: chunking and embedding on Ray tasks, ahead of the writer."""
    import ray

    feeder = IngestFeeder(ray, index, corpus, chunker)
    logger.info("%d changed documents to chunk and embed on Ray", feeder.changed_documents)
    return {"cut": feeder.cut, "embed": feeder.embed}


def ray_encoder_pool(options: PrecomputeOptions, engine: Any, spec: EncoderSpec) -> RayEncoderPool:
    """A pool of encoding actors on `options.ray`'s cluster for `engine`'s model: `options.ray_actors` of them, else
    one per GPU when the model runs on CUDA, else one per CPU slot. Actors start on first use."""
    ray = connect(options.ray or "local")
    gpu = spec.device.startswith("cuda")
    actors = options.ray_actors or encoder_slots(ray, gpu=gpu)
    return RayEncoderPool(ray, spec, actors=actors, encode_batch_tokens=engine.encode_batch_tokens, gpu=gpu)
