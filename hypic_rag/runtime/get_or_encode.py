"""Get-or-encode: the one home of segment entries. Which entries a request needs, which of them the segment source
holds, encoding the misses in bounded batches, keeping what was encoded. The source only stores (`contains_many`,
`get_many`, `put_many`, `remove_many`: `segment_source.SegmentSource`); this is the one loop that looks up, encodes
what is missing and puts it.

    entries = SegmentEntries(model, source)                       # the engine holds one (`Engine.entries`)
    found = entries.get_or_encode(segments, seam)                 # a request's entries: hits fetched, misses encoded
    missing = entries.missing(segments, seam)                     # a lookup that reads nothing (the scheduler's)
    entries.keep(seam, {token_ids: entry})                        # entries encoded elsewhere put in the source
    report = drain(entries.fill_steps(plans, encoder=pool))       # precompute, ingestion: many entries, in steps

Every way in uses it: the engine's prefill (`Engine.plan_prefill`), the scheduler (a batch's cold segments, encoded
`encode_tokens` per step and kept), the session's fill (precompute, the service's ingestion, the LlamaIndex
transformation), the encoding worker processes and the Ray actors (which run the batches `encoding_batches` plans,
through `Engine.encode_segments`). Encoding is deterministic and batches are a pure function of the segments, so an
entry is the same bytes wherever it was computed. The segment source is the runtime's protocol
(`segment_source.SegmentSource`): the persistent cache (`hypic_rag.cache`) meets it without the runtime importing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hypic_rag.entry.schema import Entry, check_seam_tokens, entry_tensor_bytes
from hypic_rag.entry.compression import decompress_entries
from hypic_rag.runtime.encode import DEFAULT_ENCODE_BATCH_TOKENS, encode_segments, plan_encode_batches
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import PREFIX_ENTRY_SEAM, mode_spec
from hypic_rag.runtime.segment_source import SegmentSource

Check = Callable[[], None]
"""A per-step check (deadline, cancellation): returns to go on, raises to stop."""

SegmentKey = tuple[int, tuple[int, ...]]
"""(entry seam, token ids): one segment entry a request needs."""

COMMIT_ENTRIES = 8
"""Entries kept per write when filling the source (and segments per in-process encoding call)."""
COMMIT_BYTES = 256 << 20
"""Tensor bytes after which a fill writes what it holds, whatever the entry count."""


# ==================================================================================================== planning
@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Segments (token id lists) whose entries must be held for one seam width."""

    seam_tokens: int
    segments: list[list[int]]

    def __post_init__(self) -> None:
        check_seam_tokens(self.seam_tokens)


def distinct_segments(segment_lists: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each distinct token sequence once, in first-seen order."""
    seen: dict[tuple[int, ...], None] = {}
    for ids in segment_lists:
        seen.setdefault(tuple(ids), None)
    return [list(ids) for ids in seen]


def plan_segments(
    prefix_ids: Sequence[int], chunk_segments: Sequence[Sequence[int]], seam_tokens: int, mode: str = "hypic", *,
    distinct: bool = True,
) -> list[SegmentPlan]:
    """The entries a `mode` request composes (`runtime.modes.MODE_TABLE`): the prefix's, for `PREFIX_ENTRY_SEAM`,
    and each chunk's (each distinct one once unless `distinct` is False), for the mode's chunk entry seam."""
    chunk_seam = mode_spec(mode).entry_seam(seam_tokens)
    if chunk_seam is None:
        raise ValueError(f"mode {mode!r} composes no segment entries; nothing to precompute for it")
    chunks = distinct_segments(chunk_segments) if distinct else [list(ids) for ids in chunk_segments]
    plans = [SegmentPlan(PREFIX_ENTRY_SEAM, [list(prefix_ids)])] if prefix_ids else []
    return plans + [SegmentPlan(chunk_seam, chunks)]


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """One segment to encode and the seam width its entry is for; `batch`: the encoding batch it belongs to, when
    the batches were planned over more segments than these (`SegmentEntries.fill_steps`), else None."""

    token_ids: tuple[int, ...]
    seam_tokens: int
    batch: int | None = None


def lpt_order(tasks: Sequence[SegmentTask]) -> list[int]:
    """Positions of `tasks`, longest segment first (ties in their given order)."""
    return sorted(range(len(tasks)), key=lambda position: -len(tasks[position].token_ids))


def encoding_batches(tasks: Sequence[SegmentTask], batch_tokens: int) -> list[list[int]]:
    """Positions of `tasks` grouped into the batches every encoder runs (`Engine.encode_segments`): per seam width,
    longest first, at most `batch_tokens` padded tokens each. A pure function of the tasks, so the same segments
    form the same batches in this process and in any number of workers, and give the same bytes. Tasks that all
    carry a `batch` number keep those batches (planned over a larger set: see `SegmentEntries.fill_steps`)."""
    if tasks and all(task.batch is not None for task in tasks):
        planned: dict[int, list[int]] = {}
        for position in lpt_order(tasks):
            planned.setdefault(tasks[position].batch, []).append(position)  # type: ignore[arg-type]
        return sorted(planned.values(), key=lambda batch: -len(tasks[batch[0]].token_ids))
    by_seam: dict[int, list[int]] = {}
    for position in lpt_order(tasks):
        by_seam.setdefault(tasks[position].seam_tokens, []).append(position)
    batches: list[list[int]] = []
    for positions in by_seam.values():
        lengths = [len(tasks[position].token_ids) for position in positions]
        batches.extend([positions[index] for index in group] for group in plan_encode_batches(lengths, batch_tokens))
    return sorted(batches, key=lambda batch: -len(tasks[batch[0]].token_ids))  # longest work first (LPT)


# ==================================================================================================== encoders
@dataclass(frozen=True, slots=True)
class StoredRemotely:
    """What an encoder yields instead of an entry it has stored in the shared remote tier itself (Ray actors of
    `precompute --ray --remote-cache`): the entry's encoded bytes, and whether it uploaded them (False: the same
    value was there). `SegmentEntries.fill_steps` counts it as encoded and keeps nothing locally."""

    value_bytes: int
    sent: bool = True


class TaskEncoder(Protocol):
    """Encodes tasks' entries, yielding (position in `tasks`, entry) in any order (e.g. a process pool,
    `hypic_rag.retrieval.encoding_pool.SegmentEncoder`, or Ray actors), or `StoredRemotely` for an entry it stored
    in the shared remote tier itself."""

    def encode(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry | StoredRemotely]]: ...


class MissEncoder(Protocol):
    """Encodes a request's cache misses somewhere else, in parallel (segment parallelism, docs/design.md): e.g.
    `hypic_rag.distributed.ray_encoder.RayEncoderPool`, which runs the batches `plan_encode_batches` makes, longest
    first, on Ray actors. It must return what `SegmentEntries.encode` would, in the order of `segments`."""

    def encode_segments(self, segments: list[list[int]], seam_tokens: int, check: Check | None = None) -> list[Entry]: ...


# ==================================================================================================== the home
@dataclass(slots=True)
class FillReport:
    """How a fill went (updated as it runs).

    segments: planned segments (a repeated one counts each time); cache_hits / cache_misses: of those, held
    before the fill / not held. to_encode, tokens_to_encode: the distinct missing ones and their tokens;
    encoded, tokens_encoded: those encoded and handed to the segment source so far; seconds: since the start.
    stored_remotely: of the encoded, those the encoder stored in the shared remote tier itself (`StoredRemotely`);
    uploaded_remotely / uploaded_remotely_bytes: how many of them it sent, and their bytes (the others were there
    already).
    """

    segments: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    to_encode: int = 0
    tokens_to_encode: int = 0
    encoded: int = 0
    tokens_encoded: int = 0
    seconds: float = 0.0
    stored_remotely: int = 0
    uploaded_remotely: int = 0
    uploaded_remotely_bytes: int = 0


@dataclass(slots=True)
class FoundEntries:
    """What `SegmentEntries.get_or_encode` found: entries in request order (on the model's device), whether each
    was held before (a hit), their tensor bytes, the seconds spent encoding the misses and all the seconds."""

    entries: list[Entry]
    hits: list[bool]
    tensor_bytes: int = 0
    encode_seconds: float = 0.0
    seconds: float = 0.0


def on_device(entry: Entry, device: torch.device) -> Entry:
    """`entry` with every tensor on `device` (itself when they are)."""
    if all(tensor.device == device for tensor in entry.values()):
        return entry
    return {name: tensor.to(device, non_blocking=True) for name, tensor in entry.items()}


class SegmentEntries:
    """One model's segment entries in one segment source (see the module docstring).

    batch_tokens: padded tokens per encoding forward (`plan_encode_batches`); miss_encoder: where `encode` runs the
    batches (None: here; e.g. Ray actors, `MissEncoder`).
    """

    def __init__(
        self, model: HybridModel, source: SegmentSource, *, batch_tokens: int = DEFAULT_ENCODE_BATCH_TOKENS,
        miss_encoder: MissEncoder | None = None,
    ) -> None:
        if batch_tokens < 1:
            raise ValueError(f"encode_batch_tokens must be positive, got {batch_tokens}")
        source.check_model(model.fingerprint, model.tokenizer_fingerprint)
        self.model = model
        self.source = source
        self.batch_tokens = batch_tokens
        self.miss_encoder = miss_encoder

    # ------------------------------------------------------------------------------------------- encoding
    def encode(self, segments: Sequence[Sequence[int]], seam_tokens: int, *, check: Check | None = None) -> list[Entry]:
        """Entries of `segments` for seam window `seam_tokens`, several per forward (batches of similar lengths up to
        `batch_tokens` padded tokens), in the order of `segments`; nothing is kept. `check` runs before each batch
        (raising stops there). With a `miss_encoder` the batches run there (on several encoders at once), with the
        same bytes."""
        segments = [list(segment) for segment in segments]
        if self.miss_encoder is not None and segments:
            return self.miss_encoder.encode_segments(segments, seam_tokens, check)
        entries: list[Entry | None] = [None] * len(segments)
        for batch in plan_encode_batches([len(segment) for segment in segments], self.batch_tokens):
            if check is not None:
                check()
            for index, entry in zip(batch, encode_segments(self.model, [segments[i] for i in batch], seam_tokens)):
                entries[index] = entry
        return entries  # type: ignore[return-value]

    def encode_tasks(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry]]:
        """(position, entry) of every task, here, in the batches every encoder uses (`encoding_batches`: the same
        segments give the same bytes here, in worker processes and on Ray actors). A `TaskEncoder`."""
        for group in encoding_batches(tasks, self.batch_tokens):
            yield from zip(group, self.encode([tasks[p].token_ids for p in group], tasks[group[0]].seam_tokens))

    # ------------------------------------------------------------------------------------------- the source
    def missing(self, segments: Sequence[Sequence[int]], seam_tokens: int) -> list[list[int]]:
        """The segments the source holds no entry of for `seam_tokens` (a lookup that reads and counts nothing)."""
        segments = [list(segment) for segment in segments]
        return [segment for segment, held in zip(segments, self.source.contains_many(seam_tokens, segments)) if not held]

    def keep(self, seam_tokens: int, encoded: Mapping[tuple[int, ...], Entry]) -> list[Entry]:
        """Hand entries encoded for `seam_tokens` (by token ids) to the source, in one write. Returns the entries as
        the source hands them back, in the order of `encoded`: their stored form (a compressed cache format,
        `hypic_rag.entry`), so a miss composes the values a later hit gets."""
        if not encoded:
            return []
        return self.source.put_many(seam_tokens, [list(ids) for ids in encoded], list(encoded.values()))

    def get_or_encode(
        self, segments: Sequence[Sequence[int]], seam_tokens: int, *, check: Check | None = None
    ) -> FoundEntries:
        """The entries of `segments` for `seam_tokens`: fetched when the source holds them, else encoded now
        (`encode`, each distinct missing segment once, `check` before each batch; if it raises, nothing is kept)
        and put in the source in one write. On the model's device, decoded from the source's stored form
        (`entry_storage.formats.decompress_entries`: once per hit, state in float32, K/V in the model's dtype)."""
        began = time.perf_counter()
        segments = [list(segment) for segment in segments]
        stored = self.source.get_many(seam_tokens, segments)
        hits = [entry is not None for entry in stored]
        missing = distinct_segments([segment for segment, hit in zip(segments, hits) if not hit])
        encode_seconds = 0.0
        if missing:
            encoding = time.perf_counter()
            encoded = self.encode(missing, seam_tokens, check=check)
            encode_seconds = time.perf_counter() - encoding
            if len(encoded) != len(missing):
                raise ValueError(f"the encoder returned {len(encoded)} entries for {len(missing)} segments")
            kept = dict(zip(map(tuple, missing), self.source.put_many(seam_tokens, missing, encoded)))
            stored = [entry if entry is not None else dict(kept[tuple(segment)])
                      for segment, entry in zip(segments, stored)]
        entries: list[Entry] = stored  # type: ignore[assignment]  # every one held or kept by now
        found = FoundEntries(
            decompress_entries(entries, self.model.device, self.model.dtype),
            hits,
            tensor_bytes=sum(entry_tensor_bytes(entry) for entry in entries),
            encode_seconds=encode_seconds,
        )
        found.seconds = time.perf_counter() - began
        return found

    # ------------------------------------------------------------------------------------------- filling
    def fill_steps(
        self, plans: Sequence[SegmentPlan], *, encoder: TaskEncoder | None = None, commit_entries: int = COMMIT_ENTRIES,
        commit_bytes: int = COMMIT_BYTES,
    ) -> Generator[FillReport, None, FillReport]:
        """Make the source hold every planned entry, in steps; the generator's return value is the report.

        The first step looks up which planned segments the source lacks (nothing is loaded or counted); each
        later one encodes one segment's entry (each distinct one once) and yields the report so far. Entries are
        encoded by `encoder` when given (any order; one it stored in the shared remote tier itself comes back as
        `StoredRemotely` and is only counted), else here (`encode_tasks`). They are handed to the source (`keep`)
        every `commit_entries` entries or `commit_bytes` tensor bytes, and at the end: one write each, so a fill
        stopped between writes keeps what it wrote.
        """
        if commit_entries < 1:
            raise ValueError(f"commit_entries must be positive, got {commit_entries}")
        began = time.perf_counter()
        report = FillReport()
        planned: list[SegmentTask] = []
        lacked: list[bool] = []
        for plan in plans:
            segments = [tuple(int(token) for token in ids) for ids in plan.segments if len(ids)]
            missing = {tuple(ids) for ids in self.missing(segments, plan.seam_tokens)}
            report.segments += len(segments)
            report.cache_misses += sum(ids in missing for ids in segments)
            for ids in dict.fromkeys(segments):
                planned.append(SegmentTask(ids, plan.seam_tokens))
                lacked.append(ids in missing)
        # The batches are planned over every planned segment, held or not, and each batch holding a missing one
        # runs whole: an entry's bytes depend on its batch's padded shape, so a resumed fill (some entries stored
        # by an interrupted one) stores the bytes an uninterrupted fill would. Held members are recomputed, dropped.
        batches = encoding_batches(planned, self.batch_tokens)
        batch_of = {position: number for number, batch in enumerate(batches) if any(lacked[p] for p in batch)
                    for position in batch}
        kept = [position for position in range(len(planned)) if position in batch_of]
        tasks = [SegmentTask(planned[p].token_ids, planned[p].seam_tokens, batch_of[p]) for p in kept]
        wanted = [lacked[p] for p in kept]
        report.cache_hits = report.segments - report.cache_misses
        report.to_encode = sum(wanted)
        report.tokens_to_encode = sum(len(task.token_ids) for task, want in zip(tasks, wanted) if want)
        report.seconds = time.perf_counter() - began
        yield report
        pending: dict[int, dict[tuple[int, ...], Entry]] = {}
        pending_entries = pending_bytes = 0
        encoded = encoder.encode(tasks) if encoder is not None else self.encode_tasks(tasks)
        for position, entry in encoded:
            if not wanted[position]:  # held already: recomputed only to keep its batch whole
                continue
            task = tasks[position]
            if isinstance(entry, StoredRemotely):  # the encoder put it in the remote tier: nothing to keep here
                report.stored_remotely += 1
                report.uploaded_remotely += entry.sent
                report.uploaded_remotely_bytes += entry.value_bytes if entry.sent else 0
            else:
                pending.setdefault(task.seam_tokens, {})[task.token_ids] = entry
                pending_entries += 1
                pending_bytes += entry_tensor_bytes(entry)
                if pending_entries >= commit_entries or pending_bytes >= commit_bytes:
                    self._keep_pending(pending)
                    pending_entries = pending_bytes = 0
            report.encoded += 1
            report.tokens_encoded += len(task.token_ids)
            report.seconds = time.perf_counter() - began
            yield report
        self._keep_pending(pending)
        report.seconds = time.perf_counter() - began
        return report

    def _keep_pending(self, pending: dict[int, dict[tuple[int, ...], Entry]]) -> None:
        """`keep` each seam width's pending entries (one write each); empties `pending`."""
        for seam, encoded in pending.items():
            self.keep(seam, encoded)
        pending.clear()
