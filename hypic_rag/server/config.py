"""Settings of the REST service: what it serves and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from hypic_rag.cache.remote_config import RemoteTierConfig
from hypic_rag.server.auth import ApiKeys, key_problem
from hypic_rag.utils.limits import MAX_QUESTION_CHARS
from hypic_rag.prompting.segments import DEFAULT_SEPARATOR as DEFAULT_SEPARATOR  # re-exported: the service's default


REPLICA_PLACEHOLDER = "{replica}"
"""In `ServerConfig.cache_dir`: replaced by each replica's name (`serve --replicas N --cache DIR/{replica}`)."""


class MissEncoderFactory(Protocol):
    """Called once by the model worker with its engine and model path; returns the started miss encoder (an
    `Engine.miss_encoder` with a `close()`), which the backend closes when it closes. Must pickle (replicas)."""

    def __call__(self, engine: Any, model_path: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How `create_app` opens its index and which limits it enforces.

    index_dir: an index made by `hypic-rag precompute` (or `hypic_rag.pipeline.precompute`).
    model_path: None uses the model recorded in the index manifest (the bundled default model for an index built
    with the defaults). dtype: "float32", "bfloat16" or "float16", the dtype the model runs in (None: the one the
    manifest recorded). read_only: open the index for search only; document endpoints then answer 409 and other
    processes may write the index. queue_size: requests waiting (not yet running: queued for the model worker or
    waiting for admission to the batch) before new ones get 429. max_running: sequences generating together in one
    batch (continuous batching; a request with n choices is n sequences). step_tokens: tokens one batched step
    runs (one per running sequence plus newly admitted prompts' recomputed tokens; see `SchedulerConfig`).
    request_timeout_s: default deadline of a request, queue wait included (a request may ask for less).
    separator: what splits an OpenAI-style completion prompt into cached segments.
    match_segments: cut completion and chat prompts around the indexed chunks and seen segments they contain
    (`hypic_rag.prompting.matching`), so text pasted without separators reuses its cached entries (a request may turn it off).
    max_body_bytes / max_question_chars / max_prompt_chars / max_prompt_tokens / max_segments (separated parts of
    one completion prompt, the query included) / max_documents / max_document_chars / max_document_tokens (of one
    document's text): sizes above these are refused with 413. max_pending_jobs: document jobs waiting before
    new ones get 429. shutdown_grace_s: how long shutdown lets the running request finish. remote_cache: the
    shared remote tier below the index's segment cache (`hypic_rag.cache.remote_config.RemoteTierConfig`, e.g.
    ``RemoteTierConfig.from_url("s3://bucket/prefix", endpoint_url=...)``; None: none); replicas given the same
    one share their entries. cache_dir: the segment cache directory (None: the one the index records), e.g. a
    node-local disk when the index lies on a shared file system (LMDB needs a local one); with replicas,
    ``{replica}`` in it is replaced by each replica's name (`for_replica`), giving each its own local cache.
    miss_encoders: builds where each request's cache misses are encoded in parallel (an `Engine.miss_encoder`, e.g.
    `hypic_rag.distributed.ray_encoder.RayMissEncoders`: Ray actors, longest batches first); None: here, in batches.
    recompute_policy: what `hypic` requests recompute (a spec of `hypic_rag.runtime.recompute_policy`, e.g.
    "whole:1"; None: the index's recorded policy, else the fixed seam); a request may name another.
    retrieval_batch: the most questions the retrieval stage embeds and searches in one batch: small, so that the
    next batch's retrieval overlaps the worker's prefill of this one (docs/service.md says why 4, measured); raise
    it where embedding batches scale (a GPU).
    prefill_wait_s: how long the model worker may hold a step whose prefills wait for admission while the
    retrieval stage is retrieving a batch, so that the batch's prefills join the same pass (a lone client's
    question never waits: nothing else is being retrieved; 0: never hold; docs/service.md, "Measured", has its
    effect).
    cache_format: the cache format the index's entries must be in (None: the index's; another raises
    `IndexMismatchError` when the service opens, docs/cache.md).
    api_key / admin_key / metrics_need_key: the keys requests must carry (`hypic_rag.server.auth`: None: open;
    the API key alone gives full access, the admin key alone is needed for document changes when set); never
    shown in the repr. `for_replica` drops them: the front that routes to replicas checks them.
    page: serve the page to ask from at `/` and its assets under `/ui/` (`routes_page.py`; False: `serve --no-ui`,
    `/` is then a 404 like any unknown path).
    """

    index_dir: Path
    model_path: Path | None = None
    device: str | None = None
    dtype: str | None = None
    model_name: str | None = None
    read_only: bool = False
    queue_size: int = 64
    max_running: int = 16
    step_tokens: int = 2048
    request_timeout_s: float = 120.0
    separator: str = DEFAULT_SEPARATOR
    match_segments: bool = True
    max_body_bytes: int = 8 << 20
    max_question_chars: int = MAX_QUESTION_CHARS
    max_prompt_chars: int = 200_000
    max_prompt_tokens: int = 16_384
    max_segments: int = 256
    max_new_tokens: int = 1_024
    max_top_k: int = 64
    hop_slots: int = 2
    retrieval_batch: int = 4
    prefill_wait_s: float = 0.05
    max_documents: int = 1_000
    max_document_chars: int = 2_000_000
    max_document_tokens: int = 500_000
    max_pending_jobs: int = 32
    finished_jobs_kept: int = 1_000
    hot_cache_bytes: int | None = None
    shutdown_grace_s: float = 30.0
    startup_timeout_s: float = 600.0
    remote_cache: RemoteTierConfig | None = None
    miss_encoders: MissEncoderFactory | None = None
    recompute_policy: str | None = None
    cache_dir: Path | None = None
    cache_format: str | None = None
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)
    metrics_need_key: bool = False
    page: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "index_dir", Path(self.index_dir).expanduser())
        if self.model_path is not None:
            object.__setattr__(self, "model_path", Path(self.model_path).expanduser())
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        positive = {
            "queue_size": self.queue_size,
            "max_running": self.max_running,
            "step_tokens": self.step_tokens,
            "request_timeout_s": self.request_timeout_s,
            "max_body_bytes": self.max_body_bytes,
            "max_question_chars": self.max_question_chars,
            "max_prompt_chars": self.max_prompt_chars,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_segments": self.max_segments,
            "max_new_tokens": self.max_new_tokens,
            "max_top_k": self.max_top_k,
            "retrieval_batch": self.retrieval_batch,
            "max_documents": self.max_documents,
            "max_document_chars": self.max_document_chars,
            "max_document_tokens": self.max_document_tokens,
            "max_pending_jobs": self.max_pending_jobs,
            "finished_jobs_kept": self.finished_jobs_kept,
            "startup_timeout_s": self.startup_timeout_s,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.step_tokens < self.max_running:
            raise ValueError(f"step_tokens ({self.step_tokens}) must be at least max_running ({self.max_running})")
        if self.hop_slots < 0:
            raise ValueError(f"hop_slots must be >= 0, got {self.hop_slots!r}")
        if isinstance(self.prefill_wait_s, bool) or not isinstance(self.prefill_wait_s, (int, float)) or not (
            0 <= self.prefill_wait_s <= 10
        ):
            raise ValueError(f"prefill_wait_s must be a number of seconds in [0, 10], got {self.prefill_wait_s!r}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s!r}")
        if self.remote_cache is not None and not isinstance(self.remote_cache, RemoteTierConfig):
            raise ValueError(f"remote_cache must be a RemoteTierConfig, got {type(self.remote_cache).__name__}")
        if not self.separator:
            raise ValueError("separator must be a non-empty string")
        if self.recompute_policy is not None:
            from hypic_rag.runtime.recompute_policy import RecomputePolicy

            RecomputePolicy.parse(self.recompute_policy)  # a bad spec: RecomputePolicyError (a ValueError)
        if self.dtype is not None:
            from hypic_rag.runtime.model import resolve_dtype

            resolve_dtype(self.dtype)  # validates the name
        for name in ("api_key", "admin_key"):
            key = getattr(self, name)
            problem = None if key is None else key_problem(key) if isinstance(key, str) else "must be a string"
            if problem is not None:
                raise ValueError(f"{name} {problem}")  # never the key itself
        if self.cache_format is not None:
            from hypic_rag.entry.compression import cache_format

            cache_format(self.cache_format)  # an unknown name: ValueError naming the choices

    @property
    def keys(self) -> ApiKeys:
        """The API keys this service checks."""
        return ApiKeys(self.api_key, self.admin_key, self.metrics_need_key)

    def for_replica(self, replica: str, *, owner: bool = False) -> ServerConfig:
        """This configuration as replica `replica` runs it: read-only (N replicas cannot all write the index)
        unless it is the `owner` (the one worker of `serve --workers N` that writes a writable index: it keeps
        `read_only` as configured), ``{replica}`` in `cache_dir` replaced by the replica's name, and no API keys:
        the front checks them, and a replica is reached through it only (a worker's Unix socket lies in a private
        directory; Ray replicas have no HTTP proxy)."""
        cache_dir = self.cache_dir
        if cache_dir is not None and REPLICA_PLACEHOLDER in str(cache_dir):
            cache_dir = Path(str(cache_dir).replace(REPLICA_PLACEHOLDER, replica))
        return replace(self, read_only=self.read_only or not owner, cache_dir=cache_dir, api_key=None, admin_key=None)
