"""Encode segment entries in-process or in N worker processes (segment parallelism, docs/design.md).

Each worker loads the model once (same path, device and dtype as the parent) and checks that its fingerprint is
the parent's, then encodes the segments it is handed with `Engine.encode_segment`. Workers are forked from a
fork server that has already imported torch, the runtime and the model's transformers module, so starting N of
them costs one import, not N (and no CUDA state is ever forked: the server never touches the device). Segments are handed out
longest first (LPT), one at a time, so the workers finish together; results come back as they complete.
Encoding is deterministic, so an entry is the same whichever process computed it. Workers never touch the cache:
the parent stores what they return.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hypic_rag.entry import Entry, check_seam_tokens

logger = logging.getLogger(__name__)

_WORKER_ENGINE: Any = None


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    """How a worker rebuilds the parent's encoder: model path, device, dtype name, default seam, fingerprint."""

    model_path: str
    device: str
    dtype: str
    seam_tokens: int
    fingerprint: str
    threads_per_worker: int = 1
    preload_modules: tuple[str, ...] = ("hypic_rag.runtime.engine", "hypic_rag.runtime.model")

    def __post_init__(self) -> None:
        check_seam_tokens(self.seam_tokens)
        if self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be positive, got {self.threads_per_worker}")


def _initialise_worker(spec: EncoderSpec) -> None:
    """Load the model in a worker process (runs once per worker)."""
    global _WORKER_ENGINE
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model

    torch.set_num_threads(spec.threads_per_worker)
    model = load_model(spec.model_path, device=spec.device, dtype=getattr(torch, spec.dtype))
    if model.fingerprint != spec.fingerprint:
        raise RuntimeError(
            f"worker loaded {spec.model_path} with fingerprint {model.fingerprint[:12]}, parent has {spec.fingerprint[:12]}"
        )
    _WORKER_ENGINE = Engine(model, seam_tokens=spec.seam_tokens)


def _encode_in_worker(task: tuple[int, list[int], int]) -> tuple[int, Entry]:
    position, token_ids, seam_tokens = task
    return position, _WORKER_ENGINE.encode_segment(token_ids, seam_tokens)


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """One segment to encode and the seam width its entry is for."""

    token_ids: tuple[int, ...]
    seam_tokens: int


def lpt_order(tasks: Sequence[SegmentTask]) -> list[int]:
    """Positions of `tasks`, longest segment first (ties in their given order)."""
    return sorted(range(len(tasks)), key=lambda position: -len(tasks[position].token_ids))


class SegmentEncoder:
    """Encodes segments with `engine` in-process (workers=1) or in a pool of worker processes."""

    def __init__(self, engine: Any, spec: EncoderSpec, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.engine = engine
        self.spec = spec
        self.workers = workers
        self._pool: Any = None

    def __enter__(self) -> SegmentEncoder:
        return self

    def _start_pool(self) -> Any:
        """The worker pool, started on first use (never when there is nothing to encode)."""
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(self.spec.preload_modules))  # effective when the server starts
            self._pool = context.Pool(self.workers, initializer=_initialise_worker, initargs=(self.spec,))
            logger.info("started %d encoding workers", self.workers)
        return self._pool

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()
            self._pool = None

    def encode(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry]]:
        """Yield (position in `tasks`, entry) for every task, longest segment handed out first."""
        order = lpt_order(tasks)
        if self.workers == 1 or not order:
            for position in order:
                task = tasks[position]
                yield position, self.engine.encode_segment(list(task.token_ids), task.seam_tokens)
            return
        work = [(position, list(tasks[position].token_ids), tasks[position].seam_tokens) for position in order]
        yield from self._start_pool().imap_unordered(_encode_in_worker, work, chunksize=1)


def threads_per_worker(workers: int) -> int:
    """Torch threads for each of `workers` processes: this process's threads shared out, at least one."""
    return max(1, torch.get_num_threads() // workers) if workers > 1 else torch.get_num_threads()
