"""The Ray side of `hypic-rag precompute --ray`: the encoder pool over the cluster (and, in `ray_ingest`, loading,
chunking and embedding as tasks). `retrieval.precompute` calls in here only when `PrecomputeOptions.ray` is set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hypic_rag.distributed.cluster import connect, encoder_slots
from hypic_rag.distributed.ray_encoder import RayEncoderPool
from hypic_rag.retrieval.encoding_pool import EncoderSpec

if TYPE_CHECKING:
    from hypic_rag.retrieval.precompute import PrecomputeOptions


def ray_encoder_pool(options: PrecomputeOptions, engine: Any, spec: EncoderSpec) -> RayEncoderPool:
    """A pool of encoding actors on `options.ray`'s cluster for `engine`'s model: `options.ray_actors` of them, else
    one per GPU when the model runs on CUDA, else one per CPU slot. Actors start on first use."""
    ray = connect(options.ray or "local")
    gpu = spec.device.startswith("cuda")
    actors = options.ray_actors or encoder_slots(ray, gpu=gpu)
    return RayEncoderPool(ray, spec, actors=actors, encode_batch_tokens=engine.encode_batch_tokens, gpu=gpu)
