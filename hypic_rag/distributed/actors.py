"""`EncoderActor`: a Ray actor holding one copy of the model, encoding batches of segments.

Each actor loads the model once (the driver's path, device and dtype), checks that its fingerprint is the
driver's, and then encodes whatever batches it is handed with `Engine.encode_segments`. A batch is one padded
forward planned by the driver (`get_or_encode.encoding_batches` / `runtime.encode.plan_encode_batches`), so an entry is
byte-identical to the one the driver's own process, a `--workers` process or any other actor would compute.
The class is plain Python; `remote_encoder_class` wraps it with `ray.remote` (importing this module does not
import Ray).

With a shared remote tier (`precompute --ray --remote-cache`), `encode_batch_to_remote` also writes each entry
straight to the remote tier, as the exact bytes a cache's put would write (`segment_cache.stored_value`), and
hands back only its size: the entries do not travel to the driver, nor through its single writer.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from typing import TYPE_CHECKING

from hypic_rag.entry.schema import Entry
from hypic_rag.retrieval.encoding_pool import EncoderSpec
from hypic_rag.runtime.get_or_encode import StoredRemotely

if TYPE_CHECKING:
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cache.remote_tier import RemoteTier

logger = logging.getLogger(__name__)


class EncoderActor:
    """Loads `spec`'s model in this Ray worker process and encodes batches of segments with it.

    A model that fails to load, or has another fingerprint than the driver's, fails the actor's construction (the
    driver reports it as one line)."""

    def __init__(self, spec: EncoderSpec, encode_batch_tokens: int) -> None:
        import torch

        from hypic_rag.runtime.engine import Engine
        from hypic_rag.runtime.model import load_model

        torch.set_num_threads(spec.threads_per_worker)
        began = time.perf_counter()
        model = load_model(spec.model_path, device=spec.device, dtype=spec.dtype)
        if model.fingerprint != spec.fingerprint:
            raise RuntimeError(
                f"it loaded {spec.model_path} with fingerprint {model.fingerprint[:12]}, the driver has "
                f"{spec.fingerprint[:12]} (another model at that path on this node?)"
            )
        self.engine = Engine(model, seam_tokens=spec.seam_tokens, encode_batch_tokens=encode_batch_tokens)
        self.load_seconds = time.perf_counter() - began
        self.busy_seconds = 0.0
        self.tokens = 0
        self._remote_tiers: dict[RemoteTierConfig, RemoteTier] = {}

    def ready(self) -> dict[str, Any]:
        """Where this actor runs and how long its model took to load (answers once the model is loaded)."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname(), "load_seconds": self.load_seconds}

    def encode_batch(self, segments: list[list[int]], seam_tokens: int) -> list[Entry]:
        """Entries of `segments` (one planned batch) in their order: dicts of CPU tensors."""
        began = time.perf_counter()
        entries = self.engine.encode_segments(segments, seam_tokens)
        self.busy_seconds += time.perf_counter() - began
        self.tokens += sum(len(segment) for segment in segments)
        return entries

    def encode_batch_to_remote(
        self, segments: list[list[int]], seam_tokens: int, namespace: CacheNamespace, remote: RemoteTierConfig
    ) -> list[Entry | StoredRemotely]:
        """`encode_batch`, each entry then stored in the remote tier `remote` under `namespace` at this seam (the
        bytes and key a cache's put would write); in order, a `StoredRemotely` for each entry the remote now holds,
        the entry itself for one it did not take (the remote failed: the driver keeps it as usual)."""
        from hypic_rag.cache.remote_tier import UPLOADED
        from hypic_rag.cache.segment_cache import stored_value

        entries = self.encode_batch(segments, seam_tokens)
        bound = namespace.with_seam(seam_tokens)
        values = [(key, value) for key, _, value in (stored_value(bound, ids, entry)
                                                     for ids, entry in zip(segments, entries))]
        outcomes = self._remote_tier(remote).store_now(values)
        return [entry if outcome is None else StoredRemotely(len(value), sent=outcome == UPLOADED)
                for entry, (_, value), outcome in zip(entries, values, outcomes)]

    def _remote_tier(self, config: RemoteTierConfig) -> RemoteTier:
        """This actor's client of the remote tier `config` (made once; uploads run in `store_now`, no queue)."""
        tier = self._remote_tiers.get(config)
        if tier is None:
            from hypic_rag.cache.remote_tier import RemoteTier

            tier = self._remote_tiers[config] = RemoteTier(config.with_options(write_behind=False))
        return tier

    def counters(self) -> dict[str, float]:
        """Tokens encoded and seconds spent encoding, since the actor started."""
        return {"tokens": self.tokens, "busy_seconds": self.busy_seconds}


def remote_encoder_class(ray: Any, *, gpu: bool) -> Any:
    """`EncoderActor` as a Ray actor class: one CPU slot each, plus one GPU when `gpu`."""
    options: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0}
    if gpu:
        options["num_gpus"] = 1
    return ray.remote(**options)(EncoderActor)
