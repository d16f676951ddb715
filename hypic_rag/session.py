"""One loaded model in use: the model, its engine, where its segment entries come from, and the prompt format.

    session = ModelSession.open("model/", cache_dir="cache/")             # from a model path
    session = ModelSession.for_index(manifest, "index/")                  # from an index manifest
    session = ModelSession.of_model(model, cache_dir=index.cache_dir)     # from an already-loaded model
    request = session.request("Who keeps bees?", [chunk_ids, ...])        # prefix + chunk segments + question
    report = session.fill_cache(session.plan(chunk_segments))             # get-or-encode many entries
    session.close()                                                       # closes (flushes) its cache

Why a *session*: this object is the span during which one loaded model is used with one segment source. It is
opened (the model loaded, its cache bound to the model's namespace), serves any number of requests, and is closed
(the cache flushed). It is not "the runtime": `hypic_rag.runtime` is the model-side code, which knows neither
prompt text nor the persistent cache (it must not import `hypic_rag.cache`), while a session opens the cache and
owns the prompt format. It is not "the engine", which assembles one request from entries, nor "the pipeline",
which adds retrieval over an index. It sits between them: the runtime and the cache below, the ways in above
(`pipeline.RagPipeline`, the service's `ServiceBackend`, the LlamaIndex `HypicRuntime`, precompute), which are
all built on a session and never build a model, an engine, a cache or a prompt layout themselves.

Everything that depends on *which* model and *which* prompt format lives here, once: tokenizing one segment
(`tokenize_segment`), the request builders (`request` for the RAG layout, `segmented_request` for separated
prompts, `segmented_prompt` for prompts cut around the known chunks its `matcher` finds, `hypic_rag.reuse`;
`know_chunks` tells the matcher an index's chunks), and filling the cache (`fill_steps` / `fill_cache`: look up
which planned entries the segment source lacks, encode only those, in batches through `Engine.encode_segments` or
with an external encoder such as the process pool of `retrieval.encoding_pool`, and keep them through the source's
own get-or-encode path).
The prompt format of an index is the whole `PromptFormat` its manifest records, so the prefix whose entry
precompute encoded is the prefix `ask` and `serve` compose.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypic_rag.entry import Entry, check_seam_tokens, entry_tensor_bytes
from hypic_rag.prompt import DEFAULT_PROMPT_FORMAT, PromptFormat, tokenize_segment
from hypic_rag.reuse import MatchSettings, Piece, SegmentedPrompt, SegmentMatcher, segment_prompt
from hypic_rag.runtime.anchoring import anchor_of, anchored_key
from hypic_rag.runtime.encode import plan_encode_batches
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.modes import PREFIX_ENTRY_SEAM, mode_spec
from hypic_rag.runtime.recompute_policy import RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.segment_source import SegmentSource
from hypic_rag.segments import segmented_request
from hypic_rag.streaming import drain
from hypic_rag.text import unencodable_message

if TYPE_CHECKING:
    from hypic_rag.cache.remote_config import RemoteTierConfig

logger = logging.getLogger(__name__)

DEFAULT_SEAM_TOKENS = 8
COMMIT_ENTRIES = 8
"""Entries kept per write when filling the cache (and segments per in-process `Engine.encode_segments` call)."""
COMMIT_BYTES = 256 << 20
"""Tensor bytes after which a fill writes what it holds, whatever the entry count."""


# ==================================================================================================== building
@dataclass(frozen=True, slots=True)
class CacheOptions:
    """How a session opens its persistent segment cache (`hypic_rag.cache.segment_cache.SegmentCache.open`).

    readonly: misses are computed, not stored (the directory must exist). best_effort: a damaged store disables
    the cache (warned) and a failed write is logged, not raised (ask, serve: the cache only saves work); without
    it both raise (precompute, whose job is to fill it). hot_budget_bytes: the in-process hot tier's budget
    (None: the cache's default). remote: the shared remote tier below the disk store
    (`hypic_rag.cache.remote_config.RemoteTierConfig`, e.g. ``RemoteTierConfig.from_url("s3://bucket/prefix")``;
    None: none); it is always best effort (a failing remote is a miss, never an error).
    """

    readonly: bool = False
    best_effort: bool = False
    hot_budget_bytes: int | None = None
    remote: RemoteTierConfig | None = None


class ModelRecord(Protocol):
    """The model an index manifest records (`hypic_rag.retrieval.manifest.ModelIdentity` meets it)."""

    @property
    def path(self) -> str: ...

    @property
    def dtype(self) -> str | None: ...


class IndexRecord(Protocol):
    """What a session reads from an index manifest. `hypic_rag.retrieval.manifest.IndexManifest` meets it: this
    module does not import the retrieval package, which is built on it."""

    @property
    def model(self) -> ModelRecord: ...

    @property
    def seam_tokens(self) -> int: ...

    @property
    def prompt_format(self) -> PromptFormat: ...

    @property
    def recompute_policy_spec(self) -> str | None: ...

    def cache_path(self, index_dir: Path) -> Path: ...

    def check_loaded_model(self, path: str | Path, model: Any) -> None: ...


# ==================================================================================================== planning
@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """Segments (token id lists) whose entries must be held for one seam width."""

    seam_tokens: int
    segments: list[list[int]]

    def __post_init__(self) -> None:
        check_seam_tokens(self.seam_tokens)


@dataclass(frozen=True, slots=True)
class SegmentTask:
    """One segment to encode and the seam width its entry is for; `batch`: the encoding batch it belongs to, when
    the batches were planned over more segments than these (`ModelSession.fill_steps`), else None."""

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
    carry a `batch` number keep those batches (planned over a larger set: see `ModelSession.fill_steps`)."""
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


class SegmentEncoder(Protocol):
    """Encodes tasks' entries, yielding (position in `tasks`, entry) in any order (e.g. a process pool,
    `hypic_rag.retrieval.encoding_pool.SegmentEncoder`), or `StoredRemotely` for an entry it stored in the shared
    remote tier itself."""

    def encode(self, tasks: Sequence[SegmentTask]) -> Iterator[tuple[int, Entry | StoredRemotely]]: ...


def distinct_segments(segment_lists: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each distinct token sequence once, in first-seen order."""
    seen: dict[tuple[int, ...], None] = {}
    for ids in segment_lists:
        seen.setdefault(tuple(ids), None)
    return [list(ids) for ids in seen]


def plan_segments(
    prefix_ids: Sequence[int],
    chunk_segments: Sequence[Sequence[int]],
    seam_tokens: int,
    mode: str = "hypic",
    *,
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


@dataclass(frozen=True, slots=True)
class StoredRemotely:
    """What an encoder yields instead of an entry it has stored in the shared remote tier itself (Ray actors of
    `precompute --ray --remote-cache`): the entry's encoded bytes, and whether it uploaded them (False: the same
    value was there). `ModelSession.fill_steps` counts it as encoded and keeps nothing locally."""

    value_bytes: int
    sent: bool = True


# ==================================================================================================== session
class ModelSession:
    """A loaded model, its engine, its segment source and the prompt format its segments are written in.

    Build it with `open` (a model path), `for_index` (an index manifest) or `of_model` (a loaded model); the
    constructor takes an engine already made. Not thread-safe, as the engine is not: one thread uses a session
    at a time (the service's worker thread; the LlamaIndex `HypicRuntime` adds a lock). `close` closes the
    segment source.
    """

    def __init__(
        self, engine: Engine, *, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT, model_path: str | Path = ""
    ) -> None:
        if engine.model.tokenizer is None:
            raise ValueError("the model has no tokenizer; a model session needs one to tokenize its segments")
        self.engine = engine
        self.prompt_format = prompt_format
        self.model_path = str(model_path)
        self._prefix_ids = tuple(self.tokenize_segment(prompt_format.prefix, "the prompt prefix"))
        self.matcher = SegmentMatcher()
        """The chunks and seen segments prompts without separators are matched against (`hypic_rag.reuse`)."""

    @classmethod
    def open(
        cls,
        model_path: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        seam_tokens: int = DEFAULT_SEAM_TOKENS,
        cache_dir: str | Path | None = None,
        cache: CacheOptions = CacheOptions(),
        prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
        recompute_policy: RecomputePolicy | str | None = None,
    ) -> ModelSession:
        """Load a model (None: the bundled default model) and open `cache_dir` as its segment cache (None: an
        in-memory one). FileNotFoundError when the directory (or the bundled model) is missing, `ModelLoadError`
        when it cannot be loaded or has no tokenizer. recompute_policy: what `hypic` recomputes (None: the fixed
        seam; `runtime.recompute_policy`)."""
        from hypic_rag.default_model import resolve_model_path
        from hypic_rag.runtime.model import load_model

        path = resolve_model_path(model_path)
        model = load_model(path, device=device, dtype=dtype, require_tokenizer=True)
        return cls.of_model(
            model, model_path=path, seam_tokens=seam_tokens, cache_dir=cache_dir, cache=cache,
            prompt_format=prompt_format, recompute_policy=recompute_policy,
        )

    @classmethod
    def for_index(
        cls,
        manifest: IndexRecord,
        index_dir: str | Path,
        *,
        model_path: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        seam_tokens: int | None = None,
        cache: CacheOptions = CacheOptions(),
        recompute_policy: RecomputePolicy | str | None = None,
        cache_dir: str | Path | None = None,
    ) -> ModelSession:
        """The session an index was built for: its model (the manifest's unless `model_path`, in the recorded
        dtype unless `dtype`; another model or dtype than the manifest's raises `IndexMismatchError`), its seam
        width (unless `seam_tokens`), its recompute policy (unless `recompute_policy`; an index without one: the
        fixed seam), its whole prompt format, and its segment cache (the one the index records unless `cache_dir`:
        e.g. a node-local disk when the index lies on a shared file system). A model directory that cannot be
        loaded raises `ModelLoadError`."""
        from hypic_rag.runtime.model import load_model

        path = Path(model_path).expanduser() if model_path else Path(manifest.model.path)
        model = load_model(path, device=device, dtype=dtype or manifest.model.dtype, require_tokenizer=True)
        manifest.check_loaded_model(path, model)
        return cls.of_model(
            model,
            model_path=path,
            seam_tokens=manifest.seam_tokens if seam_tokens is None else seam_tokens,
            cache_dir=(Path(cache_dir).expanduser() if cache_dir is not None
                       else manifest.cache_path(Path(index_dir).expanduser().resolve())),
            cache=cache,
            prompt_format=manifest.prompt_format,
            recompute_policy=recompute_policy if recompute_policy is not None else manifest.recompute_policy_spec,
        )

    @classmethod
    def of_model(
        cls,
        model: HybridModel,
        *,
        model_path: str | Path = "",
        seam_tokens: int = DEFAULT_SEAM_TOKENS,
        cache_dir: str | Path | None = None,
        cache: CacheOptions = CacheOptions(),
        prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
        recompute_policy: RecomputePolicy | str | None = None,
    ) -> ModelSession:
        """A session of an already-loaded model: `cache_dir` opened as its segment cache (bound to the model's
        namespace), or an in-memory source when None; `recompute_policy` as in `open`."""
        check_seam_tokens(seam_tokens)
        policy = as_policy(recompute_policy)  # a bad spec fails before the cache opens
        source = None if cache_dir is None else _open_cache(model, seam_tokens, Path(cache_dir).expanduser(), cache)
        try:
            engine = Engine(model, seam_tokens=seam_tokens, segment_source=source, recompute_policy=policy)
            return cls(engine, prompt_format=prompt_format, model_path=model_path)
        except BaseException:
            if source is not None:
                source.close()
            raise

    def close(self) -> None:
        """Close the segment source (a persistent cache writes its pending access notes)."""
        self.engine.segment_source.close()

    def __enter__(self) -> ModelSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- parts
    @property
    def model(self) -> HybridModel:
        return self.engine.model

    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

    @property
    def seam_tokens(self) -> int:
        return self.engine.seam_tokens

    @property
    def recompute_policy(self) -> RecomputePolicy:
        """What `hypic` requests recompute unless a call names another policy (the engine's)."""
        return self.engine.recompute_policy

    @property
    def segment_source(self) -> SegmentSource:
        return self.engine.segment_source

    @property
    def model_name(self) -> str:
        """The model directory's name ("hypic-rag" when there is none)."""
        return Path(self.model_path).name or "hypic-rag"

    @property
    def context_window(self) -> int:
        """The model's `max_position_embeddings` (4096 when its config has none)."""
        config = self.engine.model.config
        text_config = getattr(config, "text_config", None) or config
        return int(getattr(text_config, "max_position_embeddings", 4096))

    # ------------------------------------------------------------------------------------------- tokens
    def tokenize_segment(self, text: str, what: str = "the text") -> list[int]:
        """Token ids of `text` as one segment, tokenized on its own without special tokens (`prompt.tokenize_segment`);
        ValueError naming `what` when it holds a lone surrogate."""
        return tokenize_segment(self.tokenizer, text, what)

    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of `text` formatted as a retrieved-chunk segment (what the chunker stores for a chunk)."""
        return self.tokenize_segment(self.prompt_format.chunk(text))

    @property
    def prefix_ids(self) -> list[int]:
        """Token ids of the prompt prefix segment ([] for an empty prefix)."""
        return list(self._prefix_ids)

    # ------------------------------------------------------------------------------------------- requests
    def request(self, question: str, chunk_ids: Sequence[Sequence[int]] = ()) -> Request:
        """The RAG layout: the prompt prefix, one segment per chunk (the token ids of its formatted segment, as
        the chunker stores them or `chunk_ids` makes them; empty ones dropped), then the question, stripped and
        formatted with the question template; each segment tokenized on its own.

        ValueError when the question is empty or holds a lone surrogate.
        """
        message = unencodable_message(question, "the question")
        if message is not None:
            raise ValueError(message)
        question = question.strip()
        if not question:
            raise ValueError("the question is empty")
        return Request(
            prefix_ids=list(self._prefix_ids),
            chunk_ids=[list(ids) for ids in chunk_ids if len(ids)],
            question_ids=self.tokenize_segment(self.prompt_format.question(question), "the question"),
        )

    def segmented_request(self, segments: Sequence[str]) -> Request:
        """A separated prompt's request (`segments.segmented_request`): every segment but the last cached, the
        last the query; a first segment equal to the prompt prefix is the prefix segment. ValueError for an empty
        query or a lone surrogate."""
        return segmented_request(self.tokenizer, segments, self.prompt_format.prefix)

    def segmented_prompt(self, pieces: Sequence[Piece], *, match: bool = True) -> SegmentedPrompt:
        """The request of `pieces` (`hypic_rag.reuse.segment_prompt`): explicit pieces kept whole, searchable ones
        cut around the indexed chunks and seen segments `matcher` finds (when `match` and the matcher is on), the
        prompt prefix recognised. ValueError for an empty query or a lone surrogate."""
        matcher = self.matcher if match and self.matcher.settings.enabled else None
        return segment_prompt(self.tokenizer, pieces, matcher=matcher, prefix=self.prompt_format.prefix)

    def set_matching(self, settings: MatchSettings) -> None:
        """Match with `settings` from now on (the segments known so far are forgotten)."""
        self.matcher = SegmentMatcher(settings)

    def know_chunks(self, texts: Iterable[str]) -> int:
        """Let the matcher find these indexed chunks' texts in prompts (each cached as its formatted segment,
        `chunk_ids`); returns how many are long enough to be matched."""
        return self.matcher.add_chunks((text, self.prompt_format.chunk(text)) for text in texts)

    # ------------------------------------------------------------------------------------------- filling
    def plan(
        self, chunk_segments: Sequence[Sequence[int]] = (), *, include_prefix: bool = True, mode: str = "hypic",
        distinct: bool = True,
    ) -> list[SegmentPlan]:
        """The entries `mode` requests over these chunk segments compose (`plan_segments`), with the prompt
        prefix's when `include_prefix`; in `hypic` the chunks' entries are for the recompute policy's seam (the
        chunks a policy recomputes whole read none, but which ones depends on the request), and an anchored policy's
        are those of the prompt prefix's anchor followed by each chunk (`runtime.anchoring`)."""
        prefix = self._prefix_ids if include_prefix else ()
        seam = self.recompute_policy.chunk_seam(self.seam_tokens) if mode == "hypic" else self.seam_tokens
        if mode == "hypic" and self.recompute_policy.anchored and self._prefix_ids:
            anchor = anchor_of(self._prefix_ids)
            chunk_segments = [list(anchored_key(anchor, ids, seam)[1]) for ids in chunk_segments]
            seam += len(anchor)
        plans = plan_segments(prefix, chunk_segments, seam, mode, distinct=distinct)
        return [plan for plan in plans if plan.segments]

    def fill_steps(
        self,
        plans: Sequence[SegmentPlan],
        *,
        encoder: SegmentEncoder | None = None,
        commit_entries: int = COMMIT_ENTRIES,
        commit_bytes: int = COMMIT_BYTES,
    ) -> Generator[FillReport, None, FillReport]:
        """Make the segment source hold every planned entry, in steps; the generator's return value is the report.

        The first step looks up which planned segments the source lacks (nothing is loaded or counted); each
        later one encodes one segment's entry (each distinct one once) and yields the report so far. Entries are
        encoded by `encoder` when given (any order; one it stored in the shared remote tier itself comes back as
        `StoredRemotely` and is only counted), else here, longest first, `commit_entries` at a time through
        `Engine.encode_segments`. They are handed to the source through its own get-or-encode path
        (`SegmentSource.get_or_encode_segments`) every `commit_entries` entries or `commit_bytes` tensor bytes,
        and at the end: one write each, so a fill stopped between writes keeps what it wrote.
        """
        if commit_entries < 1:
            raise ValueError(f"commit_entries must be positive, got {commit_entries}")
        began = time.perf_counter()
        report = FillReport()
        planned: list[SegmentTask] = []
        lacked: list[bool] = []
        for plan in plans:
            segments = [tuple(int(token) for token in ids) for ids in plan.segments if len(ids)]
            lacking = self.segment_source.missing_segments([list(ids) for ids in segments], plan.seam_tokens)
            missing = {tuple(ids) for ids in lacking}
            report.segments += len(segments)
            report.cache_misses += sum(ids in missing for ids in segments)
            for ids in dict.fromkeys(segments):
                planned.append(SegmentTask(ids, plan.seam_tokens))
                lacked.append(ids in missing)
        # The batches are planned over every planned segment, held or not, and each batch holding a missing one
        # runs whole: an entry's bytes depend on its batch's padded shape, so a resumed fill (some entries stored
        # by an interrupted one) stores the bytes an uninterrupted fill would. Held members are recomputed, dropped.
        batches = encoding_batches(planned, self.engine.encode_batch_tokens)
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
        pending: dict[int, list[tuple[tuple[int, ...], Entry]]] = {}
        pending_entries = pending_bytes = 0
        encoded = encoder.encode(tasks) if encoder is not None else self._encode_here(tasks, commit_entries)
        for position, entry in encoded:
            if not wanted[position]:  # held already: recomputed only to keep its batch whole
                continue
            task = tasks[position]
            if isinstance(entry, StoredRemotely):  # the encoder put it in the remote tier: nothing to keep here
                report.stored_remotely += 1
                report.uploaded_remotely += entry.sent
                report.uploaded_remotely_bytes += entry.value_bytes if entry.sent else 0
            else:
                pending.setdefault(task.seam_tokens, []).append((task.token_ids, entry))
                pending_entries += 1
                pending_bytes += entry_tensor_bytes(entry)
                if pending_entries >= commit_entries or pending_bytes >= commit_bytes:
                    self._keep(pending)
                    pending_entries = pending_bytes = 0
            report.encoded += 1
            report.tokens_encoded += len(task.token_ids)
            report.seconds = time.perf_counter() - began
            yield report
        self._keep(pending)
        report.seconds = time.perf_counter() - began
        return report

    def fill_cache(
        self,
        plans: Sequence[SegmentPlan],
        *,
        encoder: SegmentEncoder | None = None,
        commit_entries: int = COMMIT_ENTRIES,
        on_progress: Callable[[FillReport], None] | None = None,
    ) -> FillReport:
        """`fill_steps` run to its end (`on_progress` sees the report after every step); returns the report."""
        return drain(self.fill_steps(plans, encoder=encoder, commit_entries=commit_entries), on_progress)

    def _encode_here(self, tasks: Sequence[SegmentTask], batch: int) -> Iterator[tuple[int, Entry]]:
        """Entries of `tasks` from this session's engine, in the batches every encoder uses (`encoding_batches`:
        the same segments give the same bytes here and in worker processes). `batch` is unused (commits are
        counted by the caller)."""
        for group in encoding_batches(tasks, self.engine.encode_batch_tokens):
            entries = self.engine.encode_segments([list(tasks[p].token_ids) for p in group], tasks[group[0]].seam_tokens)
            yield from zip(group, entries)

    def _keep(self, pending: dict[int, list[tuple[tuple[int, ...], Entry]]]) -> None:
        """Hand freshly encoded entries to the segment source, one write per seam width; empties `pending`."""
        for seam, items in pending.items():
            by_ids = dict(items)
            self.segment_source.get_or_encode_segments(
                [list(ids) for ids in by_ids], seam, lambda missing: [by_ids[tuple(ids)] for ids in missing]
            )
        pending.clear()


def _open_cache(model: HybridModel, seam_tokens: int, directory: Path, options: CacheOptions) -> SegmentSource:
    """`directory` opened as the persistent segment cache of `model`'s entries (over its remote tier, if any)."""
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache

    extra: dict[str, Any] = {}
    if options.hot_budget_bytes is not None:
        extra["hot_budget_bytes"] = options.hot_budget_bytes
    if options.remote is not None:
        from hypic_rag.cache.remote_tier import RemoteTier

        extra["remote"] = RemoteTier(options.remote)
    namespace = CacheNamespace.for_model(model, seam_tokens)
    return SegmentCache.open(
        directory, namespace=namespace, readonly=options.readonly, best_effort=options.best_effort, **extra
    )
