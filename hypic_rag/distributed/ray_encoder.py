"""`RayEncoderPool`: encoding batches scheduled longest first over `EncoderActor`s on a Ray cluster.

Two uses, one pool:

- precompute (`encode(tasks)`, a `runtime.get_or_encode.TaskEncoder`): the tasks' batches
  (`get_or_encode.encoding_batches`, longest first) are handed out as list scheduling in LPT order: every actor gets
  `in_flight_per_actor` batches, and each result that comes back frees its actor for the next longest batch. The
  driver stores what comes back (`SegmentEntries.fill_steps`: the index's single LMDB writer, small transactions),
  so a killed run keeps what it stored and resumes like a local one. With a shared remote tier (`remote`,
  `namespace`), each actor writes its entries straight to it and sends back only their sizes
  (`get_or_encode.StoredRemotely`); an entry the remote does not take comes back whole and is stored by the driver.
  A killed run keeps what the actors uploaded: the rerun's lookup (`SegmentCache.missing_segments`) asks the
  remote, as it asks the disk.
- query time (`encode_segments(segments, seam, check)`, an `Engine` miss encoder): one request's misses are cut into
  the batches the engine would run (`runtime.encode.plan_encode_batches`), the batches are assigned up front to
  actors by LPT (longest first, each to the actor with the least padded tokens so far), all run at once, and the
  entries come back in the order of `segments`. `check` (a request's deadline) runs while waiting.

The same batches run in a local process, a `--workers` process or an actor, so every entry is byte-identical to a
local run's. An actor that cannot start (model missing on its node, another fingerprint), dies, or fails a batch
stops the work with one `EncodingPoolError`; entries already stored stay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hypic_rag.entry.schema import Entry
from hypic_rag.retrieval.encoding_pool import EncoderSpec, EncodingPoolError
from hypic_rag.runtime.encode import plan_encode_batches
from hypic_rag.runtime.get_or_encode import SegmentTask, StoredRemotely, encoding_batches

if TYPE_CHECKING:
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.remote_config import RemoteTierConfig

logger = logging.getLogger(__name__)

IN_FLIGHT_PER_ACTOR = 2
"""Batches queued on each actor at a time in precompute: one running, one ready, so an actor never waits on the
driver, and the longest batches still go first."""
WAIT_POLL_SECONDS = 0.05
"""How often a query-time wait looks at its request's deadline."""


def lpt_assignment(costs: Sequence[int], workers: int) -> list[list[int]]:
    """Indices of `costs` per worker: longest first, each to the worker with the least cost so far (ties: the
    lowest worker). The classic LPT rule: its makespan is at most 4/3 of the optimum."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    loads = [0] * workers
    assigned: list[list[int]] = [[] for _ in range(workers)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(workers), key=lambda w: (loads[w], w))
        assigned[target].append(index)
        loads[target] += costs[index]
    return assigned


def batch_cost(lengths: Sequence[int]) -> int:
    """Padded tokens of one batch (its rows times its longest segment): what an encoding forward costs."""
    return len(lengths) * max(lengths) if lengths else 0


class RayEncoderPool:
    """`actors` `EncoderActor`s of `spec`'s model on the connected Ray cluster (`cluster.connect` first).

    gpu: one GPU per actor (the spec's device must then be CUDA). encode_batch_tokens: the engine's batch size in
    padded tokens; it must be the driver engine's for byte-identical batches. remote, namespace: in `encode`, the
    actors store each entry in this remote tier under the cache's `namespace` themselves (None: entries come back
    to the driver). Actors start on first use (or `start()`) and stop on `close()`.
    """

    def __init__(
        self, ray: Any, spec: EncoderSpec, *, actors: int, encode_batch_tokens: int, gpu: bool = False,
        in_flight_per_actor: int = IN_FLIGHT_PER_ACTOR, remote: RemoteTierConfig | None = None,
        namespace: CacheNamespace | None = None,
    ) -> None:
        if actors < 1:
            raise ValueError(f"actors must be >= 1, got {actors}")
        if in_flight_per_actor < 1:
            raise ValueError(f"in_flight_per_actor must be >= 1, got {in_flight_per_actor}")
        if encode_batch_tokens < 1:
            raise ValueError(f"encode_batch_tokens must be positive, got {encode_batch_tokens}")
        if (remote is None) != (namespace is None):
            raise ValueError("remote and namespace go together (the actors' uploads need both)")
        self.remote = remote
        self.namespace = namespace
        self.ray = ray
        self.spec = spec
        self.actor_count = actors
        self.encode_batch_tokens = encode_batch_tokens
        self.gpu = gpu
        self.in_flight_per_actor = in_flight_per_actor
        self._actors: list[Any] = []
        self.batches_run = 0
        self.tokens_sent = 0

    # ------------------------------------------------------------------------------------------ lifetime
    def start(self) -> RayEncoderPool:
        """Start the actors and wait until every one has loaded its model; `EncodingPoolError` if one cannot."""
        if self._actors:
            return self
        from hypic_rag.distributed.actors import remote_encoder_class

        actor_class = remote_encoder_class(self.ray, gpu=self.gpu)
        began = time.perf_counter()
        self._actors = [actor_class.remote(self.spec, self.encode_batch_tokens) for _ in range(self.actor_count)]
        try:
            ready = self.ray.get([actor.ready.remote() for actor in self._actors])
        except self.ray.exceptions.RayError as error:
            self.close()
            raise EncodingPoolError(f"an encoding actor could not start: {_reason(error)}") from None
        logger.info("%d encoding actors ready in %.1f s: %s", len(ready), time.perf_counter() - began, ready)
        return self

    def close(self) -> None:
        """Stop the actors (pending batches are dropped)."""
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                self.ray.kill(actor)
            except Exception as error:  # noqa: BLE001 - already gone; nothing to stop
                logger.debug("encoding actor already gone: %s", error)

    def __enter__(self) -> RayEncoderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def actors(self) -> int:
        return self.actor_count

    def counters(self) -> list[dict[str, float]]:
        """Each running actor's tokens encoded and busy seconds (empty before `start`)."""
        return self.ray.get([actor.counters.remote() for actor in self._actors]) if self._actors else []

    # ------------------------------------------------------------------------------------------ precompute
    def encode(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry | StoredRemotely]]:
        """Yield (position in `tasks`, entry) for every task as batches complete, longest batches handed out
        first (with `remote`: `StoredRemotely` for each entry an actor stored there); `EncodingPoolError` when an
        actor cannot start, dies or fails a batch."""
        batches = encoding_batches(tasks, self.encode_batch_tokens)
        if not batches:
            return
        self.start()
        queue = iter(batches)
        running: dict[Any, tuple[int, list[int]]] = {}  # object ref -> (actor number, batch positions)

        def submit(actor_number: int) -> None:
            batch = next(queue, None)
            if batch is None:
                return
            segments = [list(tasks[position].token_ids) for position in batch]
            actor, seam = self._actors[actor_number], tasks[batch[0]].seam_tokens
            if self.remote is not None:
                ref = actor.encode_batch_to_remote.remote(segments, seam, self.namespace, self.remote)
            else:
                ref = actor.encode_batch.remote(segments, seam)
            running[ref] = (actor_number, batch)
            self.batches_run += 1
            self.tokens_sent += sum(len(segment) for segment in segments)

        for _ in range(self.in_flight_per_actor):
            for actor_number in range(len(self._actors)):
                submit(actor_number)
        try:
            while running:
                done, _ = self.ray.wait(list(running), num_returns=1)
                ref = done[0]
                actor_number, batch = running.pop(ref)
                entries = self._result(ref)
                submit(actor_number)  # keep the actor fed while the driver stores what came back
                yield from zip(batch, entries, strict=True)
        except BaseException:
            for ref in running:
                self.ray.cancel(ref)
            raise

    # ------------------------------------------------------------------------------------------ query time
    def encode_segments(
        self, segments: list[list[int]], seam_tokens: int, check: Callable[[], None] | None = None
    ) -> list[Entry]:
        """Entries of `segments` in their order, their batches spread over the actors by LPT and run at once.

        `check` runs while waiting (a deadline, a client gone): what it raises stops the wait, and the batches
        not yet started are cancelled (none of the entries is returned)."""
        if not segments:
            return []
        if check is not None:
            check()
        self.start()
        lengths = [len(segment) for segment in segments]
        batches = plan_encode_batches(lengths, self.encode_batch_tokens)
        costs = [batch_cost([lengths[i] for i in batch]) for batch in batches]
        refs: dict[Any, list[int]] = {}
        for actor, assigned in zip(self._actors, lpt_assignment(costs, len(self._actors))):
            for number in assigned:  # in LPT order: each actor runs its longest batch first
                batch = batches[number]
                refs[actor.encode_batch.remote([list(segments[i]) for i in batch], seam_tokens)] = batch
                self.batches_run += 1
                self.tokens_sent += sum(lengths[i] for i in batch)
        entries: list[Entry | None] = [None] * len(segments)
        pending = list(refs)
        try:
            while pending:
                done, pending = self.ray.wait(pending, num_returns=len(pending), timeout=WAIT_POLL_SECONDS)
                for ref in done:
                    for index, entry in zip(refs[ref], self._result(ref), strict=True):
                        entries[index] = entry
                if pending and check is not None:
                    check()
        except BaseException:
            for ref in pending:
                self.ray.cancel(ref)
            raise
        return entries  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ results
    def _result(self, ref: Any) -> list[Any]:
        exceptions = self.ray.exceptions
        try:
            return self.ray.get(ref)
        except exceptions.RayActorError as error:
            self.close()
            cause = _reason(error)
            if "could not start" in cause or "__init__" in cause or "creation task" in cause:
                raise EncodingPoolError(f"an encoding actor could not start: {cause}") from None
            raise EncodingPoolError(f"an encoding actor died (killed, out of memory, node lost?): {cause}") from None
        except exceptions.RayTaskError as error:
            raise EncodingPoolError(f"an encoding actor failed: {_reason(error)}") from None


def _reason(error: BaseException) -> str:
    """The last meaningful line of a Ray error (its own messages carry the remote traceback)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and str(cause).strip():
        return " ".join(f"{type(cause).__name__}: {cause}".split())[:500]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:500]


def pool_for_engine(ray: Any, engine: Any, model_path: str, *, actors: int | None = None) -> RayEncoderPool:
    """A pool whose actors rebuild `engine`'s model (from `model_path`, same device kind, dtype and fingerprint) and
    run its batches (`encode_batch_tokens`): what `Engine.miss_encoder` takes. actors: None for one per GPU of the
    cluster when the model runs on CUDA, else one per CPU slot."""
    from hypic_rag.distributed.cluster import encoder_slots

    model = engine.model
    device = str(model.device)
    gpu = device.startswith("cuda")
    spec = EncoderSpec(
        model_path=str(model_path), device="cuda" if gpu else device, dtype=model.dtype_name,
        seam_tokens=engine.seam_tokens, fingerprint=model.fingerprint, threads_per_worker=1,
        preload_modules=(),
    )
    count = actors if actors is not None else encoder_slots(ray, gpu=gpu)
    return RayEncoderPool(ray, spec, actors=count, encode_batch_tokens=engine.encode_batch_tokens, gpu=gpu)


@dataclass(frozen=True, slots=True)
class RayMissEncoders:
    """A `server.config.MissEncoderFactory`: `actors` encoding actors on the Ray cluster at `address`, started when
    the model worker calls it (`serve --encode-actors K [--ray ADDRESS]`)."""

    address: str = "local"
    actors: int | None = None

    def __call__(self, engine: Any, model_path: str) -> RayEncoderPool:
        from hypic_rag.distributed.cluster import connect

        return pool_for_engine(connect(self.address), engine, model_path, actors=self.actors).start()
