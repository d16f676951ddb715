"""One loaded model in use: the model, its engine and scheduler, where its segment entries come from, the prompt format.

    session = ModelSession.open("model/", cache_dir="cache/")             # from a model path
    session = ModelSession.for_index(manifest, "index/")                  # from an index manifest
    session = ModelSession.of_model(model, cache_dir=index.cache_dir)     # from an already-loaded model
    request = session.request("Who keeps bees?", [chunk_ids, ...])        # prefix + chunk segments + question
    report = session.fill_cache(session.plan(chunk_segments))             # get-or-encode many entries
    generation = session.scheduler.generate(request)                      # the model's one scheduler
    session.close()                                                       # stops its scheduler, flushes its cache

Why a *session*: this object is the span during which one loaded model is used with one segment source. It is
opened (the model loaded, its cache bound to the model's namespace), serves any number of requests, and is closed
(the cache flushed). It is not "the runtime": `hypic_rag.runtime` is the model-side code, which knows neither
prompt text nor the persistent cache (it must not import `hypic_rag.cache`), while a session opens the cache and
owns the prompt format. It is not "the engine", which assembles one request from entries, nor "the pipeline",
which adds retrieval over an index. It sits between them: the runtime and the cache below, the ways in above
(`pipeline.RagPipeline`, the service's `ServiceBackend`, the LlamaIndex `HypicRuntime`, precompute), which are
all built on a session and never build a model, an engine, a scheduler, a cache or a prompt layout themselves:
they all generate through the session's one `scheduler` (as nano-vllm's engine owns its scheduler).

Everything that depends on *which* model and *which* prompt format lives here, once: tokenizing one segment
(`tokenize_segment`), the request builders (`request` for the RAG layout, `segmented_request` for separated
prompts, `segmented_prompt` for prompts cut around the known chunks its `matcher` finds, `hypic_rag.prompting.matching`;
`know_chunks` tells the matcher an index's chunks), and what to fill the cache with (`plan`: the entries a mode
composes over chunk segments, the prompt prefix's included); the fill itself (`fill_steps` / `fill_cache`) is the
engine's get-or-encode home's (`runtime.get_or_encode.SegmentEntries`).
The prompt format of an index is the whole `PromptFormat` its manifest records, so the prefix whose entry
precompute encoded is the prefix `ask` and `serve` compose.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat, tokenize_query, tokenize_segment
from hypic_rag.prompting.matching import MatchConfig, Piece, SegmentedPrompt, SegmentMatcher, segment_prompt
from hypic_rag.runtime.anchoring import anchor_of, anchored_key, chained_anchor
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.get_or_encode import (
    COMMIT_BYTES,
    COMMIT_ENTRIES,
    FillReport,
    SegmentPlan,
    TaskEncoder,
    distinct_segments,
    plan_segments,
)
from hypic_rag.runtime.model import HybridModel
from hypic_rag.runtime.recompute_policy import RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.segment_source import SegmentSource
from hypic_rag.runtime.scheduler import Scheduler, SchedulerConfig
from hypic_rag.prompting.segments import segmented_request
from hypic_rag.utils.streaming import drain
from hypic_rag.utils.text import unencodable_message

if TYPE_CHECKING:
    from hypic_rag.cache.remote_config import RemoteTierConfig

logger = logging.getLogger(__name__)

DEFAULT_SEAM_TOKENS = 8
SESSION_SCHEDULER = SchedulerConfig(max_waiting=None)
"""A session's scheduler limits unless given others (no bound on waiting: its callers bound their own)."""


def new_scheduler(engine: Engine, config: SchedulerConfig | None = None) -> Scheduler:
    """The one place a `Scheduler` is constructed, not started: a session's (`ModelSession.scheduler`), or a
    benchmark's over a bare engine (several limits measured on one engine)."""
    return Scheduler(engine, config)


# ==================================================================================================== building
@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How a session opens its persistent segment cache (`hypic_rag.cache.segment_cache.SegmentCache.open`).

    readonly: misses are computed, not stored (the directory must exist). best_effort: a damaged store disables
    the cache (warned) and a failed write is logged, not raised (ask, serve: the cache only saves work); without
    it both raise (precompute, whose job is to fill it). hot_budget_bytes: the in-process hot tier's budget
    (None: the cache's default). remote: the shared remote tier below the disk store
    (`hypic_rag.cache.remote_config.RemoteTierConfig`, e.g. ``RemoteTierConfig.from_url("s3://bucket/prefix")``;
    None: none); it is always best effort (a failing remote is a miss, never an error). cache_format: the format
    entries are stored in (`hypic_rag.entry.compression.CACHE_FORMATS`: ``float32``, ``int8``, ``int7``, ...;
    None: an index's own, float32 without an index); a session of an index refuses another than the index's.
    """

    readonly: bool = False
    best_effort: bool = False
    hot_budget_bytes: int | None = None
    remote: RemoteTierConfig | None = None
    cache_format: str | None = None

    def __post_init__(self) -> None:
        if self.cache_format is not None:
            from hypic_rag.entry.compression import cache_format

            cache_format(self.cache_format)  # an unknown name: ValueError before anything loads


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

    def check_cache_format(self, given: str | None, index_dir: str | Path = "DIR") -> str: ...

    def check_loaded_model(self, path: str | Path, model: Any) -> None: ...


# ==================================================================================================== session
class ModelSession:
    """A loaded model, its engine, its segment source and the prompt format its segments are written in.

    Build it with `open` (a model path), `for_index` (an index manifest) or `of_model` (a loaded model); the
    constructor takes an engine already made. Not thread-safe, as the engine is not: one thread uses a session
    at a time (the service's worker thread; the LlamaIndex `HypicRuntime` holds the scheduler's lock). `close` stops
    the scheduler and closes the segment source.
    """

    def __init__(
        self, engine: Engine, *, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT, model_path: str | Path = "",
        scheduler_config: SchedulerConfig = SESSION_SCHEDULER,
    ) -> None:
        if engine.model.tokenizer is None:
            raise ValueError("the model has no tokenizer; a model session needs one to tokenize its segments")
        self.engine = engine
        self.prompt_format = prompt_format
        self.model_path = str(model_path)
        self._prefix_ids = tuple(self.tokenize_segment(prompt_format.prefix, "the prompt prefix"))
        self.matcher = SegmentMatcher()
        """The chunks and seen segments prompts without separators are matched against (`hypic_rag.prompting.matching`)."""
        self.scheduler = new_scheduler(engine, scheduler_config)
        """The model's one scheduler, not started: a `stream` consumer steps it in its own thread unless an owner
        starts it (the LlamaIndex components) or drives its steps (the service's model worker)."""

    @classmethod
    def open(
        cls,
        model_path: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str | None = None,
        seam_tokens: int = DEFAULT_SEAM_TOKENS,
        cache_dir: str | Path | None = None,
        cache: CacheConfig = CacheConfig(),
        prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
        recompute_policy: RecomputePolicy | str | None = None,
    ) -> ModelSession:
        """Load a model (None: the bundled default model) and open `cache_dir` as its segment cache (None: an
        in-memory one). FileNotFoundError when the directory (or the bundled model) is missing, `ModelLoadError`
        when it cannot be loaded or has no tokenizer. recompute_policy: what `hypic` recomputes (None: the fixed
        seam; `runtime.recompute_policy`)."""
        from hypic_rag.demo.default_model import resolve_model_path
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
        cache: CacheConfig = CacheConfig(),
        recompute_policy: RecomputePolicy | str | None = None,
        cache_dir: str | Path | None = None,
    ) -> ModelSession:
        """The session an index was built for: its model (the manifest's unless `model_path`, in the recorded
        dtype unless `dtype`; another model or dtype than the manifest's raises `IndexMismatchError`), its seam
        width (unless `seam_tokens`), its recompute policy (unless `recompute_policy`; an index without one: the
        fixed seam), its whole prompt format, and its segment cache (the one the index records unless `cache_dir`:
        e.g. a node-local disk when the index lies on a shared file system) in the index's cache format (a
        `cache.cache_format` naming another raises `IndexMismatchError`). A model directory that cannot be loaded
        raises `ModelLoadError`."""
        from dataclasses import replace

        from hypic_rag.runtime.model import load_model

        cache = replace(cache, cache_format=manifest.check_cache_format(cache.cache_format, index_dir))
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
        cache: CacheConfig = CacheConfig(),
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
        """Stop the scheduler (sequences left fail with `SchedulerStopped`), then close the segment source between
        steps (a persistent cache writes its pending access notes)."""
        self.scheduler.stop()
        with self.scheduler.lock:
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

    def configure_scheduler(self, config: SchedulerConfig) -> Scheduler:
        """Give the scheduler the limits `config` sets (the service's flags) while it has no work (RuntimeError
        otherwise); returns it."""
        if self.scheduler.has_work:
            raise RuntimeError("the scheduler's limits can change only while it has no work")
        self.scheduler.config = config
        return self.scheduler

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
        """Token ids of `text` as one segment, tokenized on its own without special tokens (`prompting.layout.tokenize_segment`);
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
    def request(self, question: str, chunk_ids: Sequence[Sequence[int]] = (), *, tokenizer: Any = None) -> Request:
        """The RAG layout: the prompt prefix, one segment per chunk (the token ids of its formatted segment, as
        the chunker stores them or `chunk_ids` makes them; empty ones dropped), then the question, stripped and
        formatted with the question template; each segment tokenized on its own (by `tokenizer` when given: a
        copy of the session's, for a thread other than the session's owner).

        ValueError when the question is empty or holds a lone surrogate.
        """
        message = unencodable_message(question, "the question")
        if message is not None:
            raise ValueError(message)
        question = question.strip()
        if not question:
            raise ValueError("the question is empty")
        question_ids, answer_lead = tokenize_query(tokenizer or self.tokenizer, self.prompt_format.question(question))
        return Request(
            prefix_ids=list(self._prefix_ids),
            chunk_ids=[list(ids) for ids in chunk_ids if len(ids)],
            question_ids=question_ids,
            answer_lead=answer_lead,
        )

    def segmented_request(self, segments: Sequence[str]) -> Request:
        """A separated prompt's request (`prompting.segments.segmented_request`): every segment but the last cached, the
        last the query; a first segment equal to the prompt prefix is the prefix segment. ValueError for an empty
        query or a lone surrogate."""
        return segmented_request(self.tokenizer, segments, self.prompt_format.prefix)

    def segmented_prompt(self, pieces: Sequence[Piece], *, match: bool = True) -> SegmentedPrompt:
        """The request of `pieces` (`hypic_rag.prompting.matching.segment_prompt`): explicit pieces kept whole, searchable ones
        cut around the indexed chunks and seen segments `matcher` finds (when `match` and the matcher is on), the
        prompt prefix recognised. ValueError for an empty query or a lone surrogate."""
        matcher = self.matcher if match and self.matcher.settings.enabled else None
        return segment_prompt(self.tokenizer, pieces, matcher=matcher, prefix=self.prompt_format.prefix)

    def set_matching(self, settings: MatchConfig) -> None:
        """Match with `settings` from now on (the segments known so far are forgotten)."""
        self.matcher = SegmentMatcher(settings)

    def know_chunks(self, texts: Iterable[str]) -> int:
        """Let the matcher find these indexed chunks' texts in prompts (each cached as its formatted segment,
        `chunk_ids`); returns how many are long enough to be matched."""
        return self.matcher.add_chunks((text, self.prompt_format.chunk(text)) for text in texts)

    # ------------------------------------------------------------------------------------------- filling
    def plan(
        self, chunk_segments: Sequence[Sequence[int]] = (), *, include_prefix: bool = True, mode: str = "hypic",
        distinct: bool = True, successors: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    ) -> list[SegmentPlan]:
        """The entries `mode` requests over these chunk segments compose (`plan_segments`), with the prompt
        prefix's when `include_prefix`; in `hypic` the chunks' entries are for the recompute policy's seam (the
        chunks a policy recomputes whole read none, but which ones depends on the request), and an anchored policy's
        are those of the prompt prefix's anchor followed by each chunk (`runtime.anchoring`). A chained policy's
        also include, per (antecedent, chunk) pair of `successors` (consecutive chunks of one document), the entry
        of the chunk encoded after the anchor and its antecedent (`anchoring.chained_anchor`)."""
        prefix = self._prefix_ids if include_prefix else ()
        seam = self.recompute_policy.chunk_seam(self.seam_tokens) if mode == "hypic" else self.seam_tokens
        chained: dict[int, list[list[int]]] = {}
        if mode == "hypic" and self.recompute_policy.chained:
            anchor = anchor_of(self._prefix_ids)
            for antecedent, chunk in successors:
                entry_seam, ids = anchored_key(chained_anchor(anchor, antecedent), chunk, seam)
                chained.setdefault(entry_seam, []).append(list(ids))
        if mode == "hypic" and self.recompute_policy.anchored and self._prefix_ids:
            anchor = anchor_of(self._prefix_ids)
            chunk_segments = [list(anchored_key(anchor, ids, seam)[1]) for ids in chunk_segments]
            seam += len(anchor)
        plans = plan_segments(prefix, chunk_segments, seam, mode, distinct=distinct)
        plans += [SegmentPlan(entry_seam, distinct_segments(segments) if distinct else segments)
                  for entry_seam, segments in sorted(chained.items())]
        return [plan for plan in plans if plan.segments]

    def fill_steps(
        self, plans: Sequence[SegmentPlan], *, encoder: TaskEncoder | None = None, commit_entries: int = COMMIT_ENTRIES,
        commit_bytes: int = COMMIT_BYTES,
    ) -> Generator[FillReport, None, FillReport]:
        """Make the segment source hold every planned entry, in steps (`SegmentEntries.fill_steps`, the engine's
        get-or-encode home); the generator's return value is the report. `encoder`: where entries are encoded (a
        process pool, Ray actors; None: here)."""
        return self.engine.entries.fill_steps(plans, encoder=encoder, commit_entries=commit_entries,
                                              commit_bytes=commit_bytes)

    def fill_cache(
        self, plans: Sequence[SegmentPlan], *, encoder: TaskEncoder | None = None, commit_entries: int = COMMIT_ENTRIES,
        on_progress: Callable[[FillReport], None] | None = None,
    ) -> FillReport:
        """`fill_steps` run to its end (`on_progress` sees the report after every step); returns the report."""
        return drain(self.fill_steps(plans, encoder=encoder, commit_entries=commit_entries), on_progress)


def _open_cache(model: HybridModel, seam_tokens: int, directory: Path, options: CacheConfig) -> SegmentSource:
    """`directory` opened as the persistent segment cache of `model`'s entries (over its remote tier, if any)."""
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache
    from hypic_rag.entry.compression import DEFAULT_CACHE_FORMAT

    extra: dict[str, Any] = {}
    if options.hot_budget_bytes is not None:
        extra["hot_budget_bytes"] = options.hot_budget_bytes
    if options.remote is not None:
        from hypic_rag.cache.remote_tier import RemoteTier

        extra["remote"] = RemoteTier(options.remote)
    namespace = CacheNamespace.for_model(model, seam_tokens, options.cache_format or DEFAULT_CACHE_FORMAT)
    return SegmentCache.open(
        directory, namespace=namespace, readonly=options.readonly, best_effort=options.best_effort, **extra
    )
