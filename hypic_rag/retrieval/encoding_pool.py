"""Encode segment entries in-process or in N worker processes (segment parallelism, docs/design.md).

Each worker loads the model once (same path, device and dtype as the parent) and checks that its fingerprint is
the parent's, then encodes the segments it is handed with `Engine.encode_segment`. Workers are forked from a
fork server that has already imported torch, the runtime and the model's transformers module, so starting N of
them costs one import, not N (and no CUDA state is ever forked: the server never touches the device). Segments are handed out
longest first (LPT), a couple per worker at a time, so the workers finish together; results come back as they complete.
Encoding is deterministic, so an entry is the same whichever process computed it. Workers never touch the cache:
the parent stores what they return.

A worker that cannot start (its model fails to load or has another fingerprint) or that dies (killed, out of
memory) stops the whole encode with one `EncodingPoolError` naming the reason; it is never restarted (a
`multiprocessing.Pool` restarts a worker whose initializer raised, forever).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import torch

from hypic_rag.entry.schema import Entry, check_seam_tokens
from hypic_rag.errors import HypicError
from hypic_rag.retrieval.errors import RetrievalError
from hypic_rag.runtime.get_or_encode import SegmentTask, encoding_batches, lpt_order  # noqa: F401 (lpt_order re-exported)

__all__ = [
    "EncoderSpec",
    "EncodingPoolError",
    "SegmentEncoder",
    "SegmentTask",
    "WorkerStartError",
    "lpt_order",
    "threads_per_worker",
]

logger = logging.getLogger(__name__)

_WORKER_ENGINE: Any = None
_WORKER_START_ERROR: str | None = None

WORKER_DIED = "an encoding worker process died (killed or out of memory?); try fewer --workers"

IN_FLIGHT_PER_WORKER = 2
"""Segments handed out per worker at a time: enough to keep each busy, few enough that results never pile up and
each wait looks at a handful of futures (not all N, which would make the loop O(N^2))."""


class EncodingPoolError(RetrievalError):
    """An encoding worker could not start, died, or failed a segment; the encode stopped (one-line message)."""


class WorkerStartError(HypicError, RuntimeError):
    """Raised by a worker's tasks when the worker could not start (carries the reason as its message); the parent
    raises it as an `EncodingPoolError`."""


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
    """Load the model in a worker process (runs once per worker).

    Never raises: a failure is kept and raised by every task this worker is given (`WorkerStartError`), so the
    parent sees it as the result of its first task instead of the worker being restarted.
    """
    global _WORKER_ENGINE, _WORKER_START_ERROR
    try:
        from hypic_rag.runtime.engine import Engine
        from hypic_rag.runtime.model import load_model

        torch.set_num_threads(spec.threads_per_worker)
        model = load_model(spec.model_path, device=spec.device, dtype=spec.dtype)
        if model.fingerprint != spec.fingerprint:
            raise RuntimeError(
                f"it loaded {spec.model_path} with fingerprint {model.fingerprint[:12]}, the parent has "
                f"{spec.fingerprint[:12]} (was the model changed on disk?)"
            )
        _WORKER_ENGINE = Engine(model, seam_tokens=spec.seam_tokens)
    except BaseException as error:  # noqa: BLE001 - reported through the tasks, see the docstring
        _WORKER_START_ERROR = " ".join(str(error).split()) or type(error).__name__


def _encode_in_worker(batch: tuple[list[int], list[list[int]], int]) -> list[tuple[int, Entry]]:
    """One encoding batch in a worker: (positions, token id lists, seam) -> [(position, entry)]."""
    if _WORKER_START_ERROR is not None:
        raise WorkerStartError(_WORKER_START_ERROR)
    positions, segments, seam_tokens = batch
    return list(zip(positions, _WORKER_ENGINE.encode_segments(segments, seam_tokens)))


class SegmentEncoder:
    """Encodes segments with `engine` in-process (workers=1) or in a pool of worker processes; a
    `hypic_rag.runtime.get_or_encode.TaskEncoder` (what `SegmentEntries.fill_steps` takes)."""

    def __init__(self, engine: Any, spec: EncoderSpec, workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.engine = engine
        self.spec = spec
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> SegmentEncoder:
        return self

    def _start_pool(self) -> ProcessPoolExecutor:
        """The worker pool, started on first use (never when there is nothing to encode)."""
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(self.spec.preload_modules))  # effective when the server starts
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_initialise_worker, initargs=(self.spec,)
            )
            logger.info("started %d encoding workers", self.workers)
        return self._pool

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.close(wait=exc_type is None)

    def close(self, wait: bool = True) -> None:
        """Stop the workers: after their current segments when `wait`, else at once (pending segments dropped)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if wait:
            pool.shutdown(wait=True)
            return
        workers = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on them (3.11)
        pool.shutdown(wait=False, cancel_futures=True)
        for process in workers:
            if process.is_alive():
                process.terminate()
        for process in workers:
            process.join()

    def encode(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry]]:
        """Yield (position in `tasks`, entry) for every task, longest segment handed out first.

        Raises `EncodingPoolError` (workers stopped) when a worker cannot start, dies, or fails a segment.
        """
        batches = encoding_batches(tasks, self.engine.encode_batch_tokens)
        if self.workers == 1 or not batches:
            yield from self.engine.entries.encode_tasks(tasks)  # the same batches, here
            return
        pool = self._start_pool()
        queue = iter(batches)
        pending: set[Future] = set()

        def submit(count: int) -> None:
            for batch in itertools.islice(queue, count):
                segments = [list(tasks[position].token_ids) for position in batch]
                pending.add(pool.submit(_encode_in_worker, (batch, segments, tasks[batch[0]].seam_tokens)))

        try:
            try:
                submit(self.workers * IN_FLIGHT_PER_WORKER)
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    pending.difference_update(done)
                    submit(len(done))  # keep the workers fed while this process stores what came back
                    for future in done:
                        yield from self._result(future)
                    del done
            except BrokenProcessPool:  # from submit or a result: a worker process died
                raise EncodingPoolError(WORKER_DIED) from None
        except BaseException:
            for future in pending:
                future.cancel()
            self.close(wait=False)
            raise

    @staticmethod
    def _result(future: Future) -> list[tuple[int, Entry]]:
        try:
            return future.result()
        except WorkerStartError as error:
            raise EncodingPoolError(f"an encoding worker could not start: {error}") from None
        except BrokenProcessPool:
            raise
        except Exception as error:
            logger.debug("encoding worker failed", exc_info=error)
            raise EncodingPoolError(f"an encoding worker failed: {type(error).__name__}: {error}") from None


def threads_per_worker(workers: int) -> int:
    """Torch threads for each of `workers` processes: this process's threads shared out, at least one."""
    return max(1, torch.get_num_threads() // workers) if workers > 1 else torch.get_num_threads()
