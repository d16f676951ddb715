"""Precompute: load a corpus, chunk, embed, index, and encode every chunk into the segment cache.

It builds an index (`retrieval`) and fills the cache of the `session.ModelSession` it was built for, so it sits
above both, as `answering.py` does (the retrieval package never imports the session).

    summary = precompute(PrecomputeConfig(corpus="docs/", index_dir="index/", model_path="model/"))
    summary = build_index("docs/", "index/")   # the same from Python, on the bundled model unless `model=...`

Resumable at every step: documents are committed one by one (an unchanged document is skipped by its content
digest), and the encode phase asks the cache which segments it already holds and encodes only the others,
storing them in small transactions as they complete. Interrupted and rerun, it finishes what is left; rerun on an
unchanged corpus it embeds, indexes and encodes nothing. Besides the chunks, the prompt prefix segment is encoded
too (for seam 0, as the runtime composes it), so the first `ask` finds every segment of its prompt in the cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

from hypic_rag.demo.world import DEMO_MODEL_NOTE, CorpusFit, WorldCheck, is_bundled_model
from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.entry.compression import DEFAULT_CACHE_FORMAT, cache_format
from hypic_rag.utils.paths import unusable_directory_reason
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.chunk_context import DEFAULT_RETRIEVAL, RetrievalSettings
from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
from hypic_rag.retrieval.corpus_index import (
    DEFAULT_CACHE_DIR,
    LOCK_FILE,
    CorpusIndex,
    IndexConfig,
    IngestReport,
    check_index_location,
)
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.encoding_pool import EncoderConfig, SegmentEncoder, threads_per_worker
from hypic_rag.retrieval.errors import IndexLocationError, IndexMismatchError
from hypic_rag.retrieval.faiss_index import VectorIndexConfig
from hypic_rag.retrieval.loading import LoadedCorpus, SkippedInput, load_corpus
from hypic_rag.retrieval.manifest import MANIFEST_FILE, IndexManifest, ModelIdentity
from hypic_rag.runtime.recompute_policy import RecomputePolicy
from hypic_rag.runtime.get_or_encode import SegmentPlan, TaskEncoder, distinct_segments, plan_segments
from hypic_rag.pipeline.session import CacheConfig, ModelSession
from hypic_rag.utils.streaming import ResultStream

if TYPE_CHECKING:
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.remote_config import RemoteTierConfig
    from hypic_rag.cache.segment_cache import SegmentCache

logger = logging.getLogger(__name__)

__all__ = [
    "EncodeReport",
    "PrecomputeConfig",
    "PrecomputeSummary",
    "ScaleOut",
    "SegmentPlan",
    "build_index",
    "bundled_model_fit",
    "cache_bytes_of",
    "distinct_segments",
    "encode_plans",
    "plan_segments",
    "precompute",
    "recorded_cache_format",
    "recorded_dtype",
    "recorded_recompute_policy",
]


@dataclass(frozen=True, slots=True)
class PrecomputeConfig:
    """What to precompute and how.

    corpus: directory or file to load. index_dir: the index directory (created if absent). model_path: local
    checkpoint of the generation model. chunk_tokens: most tokens per chunk segment. workers: processes that
    encode cache misses (1: in this process). seam_tokens: seam width w the cache entries are encoded for.
    vector_index: FAISS settings (None: keep the index's, flat for a new one). cache_dir: segment cache directory
    (None: `<index_dir>/segment_cache`). embedder_path: a local sentence-transformers directory (None: shipped
    default). device: model device (None: CUDA when available, else CPU). dtype: "float32", "bfloat16" or
    "float16", the dtype the model runs in (None: the one an existing index recorded, else float32 on CPU and
    bfloat16 on CUDA); cache entries are encoded in, and keyed by, that dtype. remote_cache: a shared remote tier
    (`hypic_rag.cache.remote_config.RemoteTierConfig`): chunks it holds are not encoded again, every entry
    encoded (or found on disk but not in the remote) is uploaded, and the run waits for the uploads; with
    `scale_out`, the encoding actors write their entries to it themselves (this host's disk then holds only what
    the remote did not take). scale_out: None (this machine
    only) or where loading, chunking, embedding and encoding run instead (`ScaleOut`; e.g.
    `hypic_rag.distributed.ray_scale_out.RayScaleOut`: Ray tasks and actors), while this process stays the
    index's single writer. cache_format: the format cache entries are stored in (a name of
    `hypic_rag.entry.compression.CACHE_FORMATS`; None: an existing index's, float32 for a new one); naming
    another than an existing index's rebuilds its cache in it: every planned entry is encoded in the new format,
    then the manifest records it and the old format's entries are removed. embedding_context: what each chunk is
    embedded with (`hypic_rag.retrieval.chunk_context.EMBEDDING_CONTEXTS`; None: an existing index's, else
    `DEFAULT_RETRIEVAL`'s; another than an existing index's is refused). neighbours: the neighbour expansion the
    index records for its searches (`KIND:SLOTS`; None: an existing index's, else the default's). recompute_policy:
    the policy spec whose entries are encoded (None: the one the index records, `hypic-rag calibrate`; an index
    without one: the fixed seam): an anchored policy's entries are encoded after the prompt prefix's anchor, a
    chained policy's also for every chunk that follows the previous chunk of its document (`ModelSession.plan`);
    not recorded in the manifest.
    """

    corpus: Path
    index_dir: Path
    model_path: Path
    chunk_tokens: int = 256
    workers: int = 1
    seam_tokens: int = 8
    vector_index: VectorIndexConfig | None = None
    cache_dir: Path | None = None
    embedder_path: Path | None = None
    device: str | None = None
    dtype: str | None = None
    embed_batch_size: int = 64
    prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT
    show_progress: bool = True
    remote_cache: RemoteTierConfig | None = None
    scale_out: ScaleOut | None = None
    cache_format: str | None = None
    recompute_policy: str | None = None
    embedding_context: str | None = None
    neighbours: str | None = None

    def __post_init__(self) -> None:
        if self.recompute_policy is not None:
            RecomputePolicy.parse(self.recompute_policy)  # a bad spec: RecomputePolicyError naming the forms
        if self.cache_format is not None:
            cache_format(self.cache_format)  # an unknown name: ValueError naming the choices
        self.retrieval(None)  # validates the embedding context and the neighbour expansion
        ChunkerConfig(chunk_tokens=self.chunk_tokens)  # validates chunk_tokens
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.scale_out is not None and self.workers > 1:
            raise ValueError("--workers and --ray exclude each other (with --ray, --ray-actors sets the encoders)")
        check_seam_tokens(self.seam_tokens)
        if self.embed_batch_size < 1:
            raise ValueError(f"embed_batch_size must be positive, got {self.embed_batch_size}")
        if self.dtype is not None:
            from hypic_rag.runtime.model import resolve_dtype

            resolve_dtype(self.dtype)  # validates the name


    def retrieval(self, recorded: RetrievalSettings | None) -> RetrievalSettings | None:
        """The retrieval settings to ask of an index that records `recorded` (None: a new index): those with
        `embedding_context` and `neighbours` applied, or None when neither is given and the index exists."""
        if self.embedding_context is None and self.neighbours is None and recorded is not None:
            return None
        base = recorded or DEFAULT_RETRIEVAL
        if self.embedding_context is not None:
            base = replace(base, embedding_context=self.embedding_context)
        return base.with_neighbours(self.neighbours)


class ScaleOut(Protocol):
    """Where precompute's work runs when not all in this process (`PrecomputeConfig.scale_out`); this process
    stays the index's and cache's single writer, in corpus order, so the result is a local run's."""

    def load_corpus(self, path: Path) -> LoadedCorpus:
        """The corpus at `path`, as `load_corpus(path)` would load it."""
        ...

    def ingest_hooks(self, index: CorpusIndex, corpus: LoadedCorpus, chunker: Chunker) -> dict[str, Any]:
        """`cut` and `embed` for `CorpusIndex.ingest` (what this process's chunker and embedder would return)."""
        ...

    def encoder(
        self, engine: Any, spec: EncoderConfig, *, remote: RemoteTierConfig | None = None,
        namespace: CacheNamespace | None = None,
    ) -> AbstractContextManager[TaskEncoder]:
        """An encoder of `spec`'s model running `engine`'s batches (closed at the end of the `with`). With `remote`
        and `namespace` (the cache's), it may store entries in that remote tier itself, as the bytes the cache
        would write, and yield `get_or_encode.StoredRemotely` for them."""
        ...


@dataclass(frozen=True, slots=True)
class EncodeReport:
    """The encode phase: segments considered (chunks plus the prefix), encoded, their tokens, seconds; of the
    encoded, those the encoders stored in the remote tier themselves (`stored_remotely`: not on this host's disk),
    how many of them they uploaded and those bytes (the others were there already)."""

    segments: int = 0
    encoded: int = 0
    tokens_encoded: int = 0
    seconds: float = 0.0
    stored_remotely: int = 0
    uploaded_remotely: int = 0
    uploaded_remotely_bytes: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_encoded / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PrecomputeSummary:
    """What a precompute run found, changed and measured."""

    documents: int
    chunks: int
    tokens: int
    ingest: IngestReport
    encode: EncodeReport
    cache_bytes: int
    cache_dir: Path
    elapsed_seconds: float
    skipped: tuple[SkippedInput, ...] = field(default_factory=tuple)
    remote: dict[str, Any] | None = None
    """The remote tier's counters after the run (`RemoteTier.stats`), when one was given."""
    cache_format: str = DEFAULT_CACHE_FORMAT
    """The format the index's cache entries are stored in after the run."""
    rebuilt_from: str | None = None
    """The format the cache was rebuilt from (`--cache-format` naming another than the index's), else None."""
    removed_entries: int = 0
    """Entries of the old format removed after a rebuild."""
    note: str | None = None
    """`hypic_rag.demo.world.DEMO_MODEL_NOTE` when the bundled demo model indexed chunks outside its world."""

    @property
    def did_work(self) -> bool:
        return self.ingest.changed or self.encode.encoded > 0


def encode_plans(
    session: ModelSession, plans: Sequence[SegmentPlan], encoder: TaskEncoder | None = None, *,
    show_progress: bool = True,
) -> EncodeReport:
    """Encode the planned segments missing from the session's cache (`ModelSession.fill_steps`), with `encoder`
    (a pool of worker processes) or in this process, storing them in small transactions as they complete."""
    fill = ResultStream(session.fill_steps(plans, encoder=encoder))
    lookup = next(fill)
    logger.info("%d of %d segments missing from the cache (%d tokens)",
                lookup.to_encode, lookup.segments, lookup.tokens_to_encode)
    actors = getattr(encoder, "actors", None)  # a Ray pool: its rate is the cluster's
    with tqdm(
        total=lookup.tokens_to_encode, unit="tok", unit_scale=True,
        desc=f"encoding on {actors} actors" if actors else "encoding",
        disable=not show_progress or not lookup.to_encode,
    ) as progress:
        for report in fill:
            progress.update(report.tokens_encoded - progress.n)
            progress.set_postfix_str(f"segments {report.encoded}/{report.to_encode}", refresh=False)
    report = fill.result
    return EncodeReport(
        segments=report.segments, encoded=report.encoded, tokens_encoded=report.tokens_encoded, seconds=report.seconds,
        stored_remotely=report.stored_remotely, uploaded_remotely=report.uploaded_remotely,
        uploaded_remotely_bytes=report.uploaded_remotely_bytes,
    )


def cache_bytes_of(
    cache: SegmentCache, namespace_for: Callable[[int], CacheNamespace], plans: Sequence[SegmentPlan]
) -> int:
    """Stored bytes of the planned segments' cache entries."""
    return sum(cache.stored_bytes(namespace_for(plan.seam_tokens), plan.segments) for plan in plans)


def recorded_dtype(index_dir: Path) -> str | None:
    """The model dtype an existing index at `index_dir` was built with (None: no index, or none recorded)."""
    manifest = _existing_manifest(index_dir)
    return None if manifest is None else manifest.model.dtype


def recorded_cache_format(index_dir: Path) -> str | None:
    """The cache format of an existing index at `index_dir` (None: no index)."""
    manifest = _existing_manifest(index_dir)
    return None if manifest is None else manifest.cache_format


def recorded_recompute_policy(index_dir: Path) -> str | None:
    """The recompute policy spec an existing index at `index_dir` records (None: no index, or none recorded)."""
    manifest = _existing_manifest(index_dir)
    return None if manifest is None else manifest.recompute_policy_spec


def _existing_manifest(index_dir: Path) -> IndexManifest | None:
    index_dir = Path(index_dir).expanduser()
    return IndexManifest.load(index_dir) if (index_dir / MANIFEST_FILE).is_file() else None


def check_locations(index_dir: Path, cache_dir: Path | None = None) -> Path:
    """Check the index and segment cache (None: the default place) paths before anything is created; the cache
    directory the run will use.

    Raises IndexLocationError for a path that is a file, lies inside a file or is not writable, or an index path
    that is a non-empty directory holding no index (the corpus itself, a home directory); IndexMismatchError
    when `cache_dir` is not the cache an existing index records; IndexCorruptError for an unreadable
    manifest. Creates nothing, so a refused run leaves no index behind."""
    index_dir = Path(index_dir).expanduser().resolve()
    check_index_location(index_dir)
    given = Path(cache_dir).expanduser().resolve() if cache_dir is not None else None
    if (index_dir / MANIFEST_FILE).is_file():
        cache_dir = IndexManifest.load(index_dir).cache_path(index_dir)
        reason = unusable_directory_reason(cache_dir)
        if reason is not None:
            raise IndexLocationError(
                f"the segment cache this index records is unusable: {reason}; delete {index_dir} and rerun"
            )
        if given is not None and given != cache_dir:
            raise IndexMismatchError(
                f"index {index_dir} keeps its segment cache in {cache_dir}, not {given}; "
                "omit --cache or use a new index directory"
            )
        return cache_dir
    cache_dir = given if given is not None else index_dir / DEFAULT_CACHE_DIR
    if index_dir.is_dir():
        expected = {LOCK_FILE, MANIFEST_FILE + ".tmp"}  # what a first run killed before its manifest leaves
        if cache_dir.is_relative_to(index_dir) and cache_dir != index_dir:
            expected.add(cache_dir.relative_to(index_dir).parts[0])
        others = sorted(child.name for child in index_dir.iterdir() if child.name not in expected)
        if others:
            raise IndexLocationError(
                f"index directory unusable: {index_dir} is not empty and holds no index (no {MANIFEST_FILE}, "
                f"but {others[0]!r}{' and more' if len(others) > 1 else ''}); pass a new or empty --index"
            )
    reason = unusable_directory_reason(cache_dir)
    if reason is not None:
        raise IndexLocationError(f"segment cache directory unusable: {reason}; pass another --cache")
    return cache_dir


def precompute(options: PrecomputeConfig, corpus: LoadedCorpus | None = None) -> PrecomputeSummary:
    """Load (unless `corpus` is given, loaded from `options.corpus`), chunk, embed, index and encode.

    Every path is checked first (`check_locations`), and the segment cache is opened before the index is
    created, so a bad index or cache path leaves nothing behind."""
    from hypic_rag.runtime.model import load_model

    began = time.perf_counter() - (corpus.load_seconds if corpus is not None else 0.0)  # elapsed counts loading
    cache_dir = check_locations(options.index_dir, options.cache_dir)
    scale_out = options.scale_out
    if corpus is None:
        corpus = load_corpus(options.corpus) if scale_out is None else scale_out.load_corpus(options.corpus)
    model = load_model(
        options.model_path, device=options.device, dtype=options.dtype or recorded_dtype(options.index_dir),
        require_tokenizer=True,
    )
    existing = _existing_manifest(options.index_dir)
    recorded_format = recorded_cache_format(options.index_dir)
    policy = options.recompute_policy or recorded_recompute_policy(options.index_dir)
    chosen_format = options.cache_format or recorded_format or DEFAULT_CACHE_FORMAT
    embedder = SentenceEmbedder(options.embedder_path, batch_size=options.embed_batch_size)
    settings = IndexConfig(
        model=ModelIdentity.of(Path(options.model_path).resolve(), model),
        chunker=ChunkerConfig(chunk_tokens=options.chunk_tokens),
        prompt_format=options.prompt_format,
        seam_tokens=options.seam_tokens,
        vector_index=options.vector_index,
        cache_dir=options.cache_dir,
        cache_format=chosen_format,
        retrieval=options.retrieval(None if existing is None else existing.retrieval_settings),
    )
    # the cache opens before the index is created: a path that cannot hold a cache leaves no index behind
    remote = options.remote_cache
    # precompute fills the remote tier: an upload waits for room in the queue instead of being dropped
    cache_options = CacheConfig(remote=remote.with_options(wait_when_full=True) if remote is not None else None,
                                 cache_format=chosen_format)
    with (
        ModelSession.of_model(
            model, model_path=options.model_path, seam_tokens=options.seam_tokens, cache_dir=cache_dir,
            prompt_format=options.prompt_format, cache=cache_options, recompute_policy=policy,
        ) as session,
        CorpusIndex.open_for_update(options.index_dir, embedder, settings) as index,
    ):
        chunker = Chunker(model.tokenizer, settings.chunker, options.prompt_format)
        hooks = {} if scale_out is None else scale_out.ingest_hooks(index, corpus, chunker)
        ingest = index.ingest(corpus, chunker, show_progress=options.show_progress, **hooks)
        fit = bundled_model_fit(options.model_path, model.tokenizer, index)
        chunks = list(index.docstore.iter_chunks())  # by document, then position
        successors = [(list(before.token_ids), list(chunk.token_ids)) for before, chunk in zip(chunks, chunks[1:])
                      if chunk.doc_id == before.doc_id and chunk.position == before.position + 1]
        plans = session.plan([list(chunk.token_ids) for chunk in chunks], successors=successors)
        cache = session.segment_source
        if scale_out is not None:  # with a remote tier, the actors write their entries there themselves
            direct = {} if remote is None or remote.read_only else {"remote": remote, "namespace": cache.namespace}
            with scale_out.encoder(session.engine, encoder_spec(options, model, threads=1), **direct) as pool:
                encode = encode_plans(session, plans, pool, show_progress=options.show_progress)
        elif options.workers > 1:
            with SegmentEncoder(session.engine, encoder_spec(options, model), workers=options.workers) as pool:
                encode = encode_plans(session, plans, pool, show_progress=options.show_progress)
        else:
            encode = encode_plans(session, plans, show_progress=options.show_progress)
        remote_stats = publish_to_remote(cache, plans, encode) if remote is not None else None
        rebuilt_from = recorded_format if recorded_format not in (None, chosen_format) else None
        removed = 0
        if rebuilt_from is not None:  # every planned entry is held in the new format now: switch, drop the old
            index.record_cache_format(chosen_format)
            removed = drop_format_entries(cache, rebuilt_from, plans)
            logger.info("cache rebuilt from format %s to %s; %d entries of %s removed", rebuilt_from, chosen_format,
                        removed, rebuilt_from)
        cache_bytes = cache_bytes_of(cache, cache.namespace_for, plans)
        counts = index.counts()
        return PrecomputeSummary(
            documents=counts.documents,
            chunks=counts.chunks,
            tokens=counts.tokens,
            ingest=ingest,
            encode=encode,
            cache_bytes=cache_bytes,
            cache_dir=index.cache_dir,
            elapsed_seconds=time.perf_counter() - began,
            skipped=tuple(corpus.skipped),
            remote=remote_stats,
            cache_format=chosen_format,
            rebuilt_from=rebuilt_from,
            removed_entries=removed,
            note=None if fit is None or fit.in_world else DEMO_MODEL_NOTE,
        )


def build_index(
    corpus: str | Path, index_dir: str | Path, *, model: str | Path | None = None, **options: Any,
) -> PrecomputeSummary:
    """Build the index of `corpus` in `index_dir`, or bring it up to date: load, chunk, embed and index the documents
    and encode every chunk into the segment cache once (`precompute`, what `hypic-rag precompute` runs).

    corpus: a folder (or one file) of .txt, .md, .jsonl, .pdf, .html and .docx documents. index_dir: created if
    absent. model: a local checkpoint directory (None: the bundled default model). options: any other field of
    `PrecomputeConfig` (chunk_tokens=256, seam_tokens=8, workers, device, dtype, cache_dir, cache_format,
    remote_cache, recompute_policy, show_progress, ...). Rerun on an unchanged corpus it embeds and encodes nothing;
    on a changed one, only what changed. Returns the run's `PrecomputeSummary` (documents, chunks, tokens, what was encoded, bytes,
    seconds); open the index with `RagPipeline.open(index_dir)`. Bad paths and options raise before anything is
    created (`HypicError`s, `ValueError`, `TypeError` for an unknown option).
    """
    from hypic_rag.demo.default_model import resolve_model_path

    return precompute(PrecomputeConfig(
        corpus=Path(corpus).expanduser(), index_dir=Path(index_dir).expanduser(), model_path=resolve_model_path(model),
        **options,
    ))


def bundled_model_fit(model_path: Path, tokenizer: Any, index: CorpusIndex) -> CorpusFit | None:
    """For the bundled demo model, how the index's chunks fit its synthetic world, recorded in the manifest (None,
    and nothing recorded, for any other model); `hypic_rag.demo.world`."""
    fit = None
    if is_bundled_model(model_path):
        fit = WorldCheck(tokenizer).fit(chunk.text for chunk in index.docstore.iter_chunks())
        if not fit.in_world:
            logger.info("%d of %d chunks lie outside the bundled model's synthetic world (%.0f%% single-token words)",
                        fit.foreign_chunks, fit.chunks, 100 * fit.single_token_word_share)
    index.record_bundled_model_fit(fit)
    return fit


def drop_format_entries(cache: SegmentCache, old_format: str, plans: Sequence[SegmentPlan]) -> int:
    """Remove the planned segments' entries in `old_format` (the cache's namespace in that format); the number
    removed."""
    from dataclasses import replace

    return sum(cache.remove_many(replace(cache.namespace_for(plan.seam_tokens), cache_format=old_format),
                                 plan.segments) for plan in plans)


def publish_to_remote(
    cache: SegmentCache, plans: Sequence[SegmentPlan], encode: EncodeReport | None = None
) -> dict[str, Any]:
    """Upload the planned entries the disk holds and the remote tier lacks, wait for every queued upload, and
    return the remote tier's counters (``remote_*`` of `SegmentCache.stats`), the uploads the encoders made
    themselves (`encode`) added in (``remote_puts``, ``remote_bytes_written``, ``remote_puts_skipped``; and
    ``remote_puts_by_encoders``)."""
    published = sum(cache.publish(cache.namespace_for(plan.seam_tokens), plan.segments) for plan in plans)
    if published:
        logger.info("%d entries on disk but not in the remote tier handed to it", published)
    cache.flush_remote()
    stats = {name: value for name, value in cache.stats().items() if name.startswith("remote_")}
    if encode is not None and encode.stored_remotely:
        stats["remote_puts"] += encode.uploaded_remotely
        stats["remote_bytes_written"] += encode.uploaded_remotely_bytes
        stats["remote_puts_skipped"] += encode.stored_remotely - encode.uploaded_remotely
        stats["remote_puts_by_encoders"] = encode.uploaded_remotely
    return stats


def encoder_spec(options: PrecomputeConfig, model: Any, *, threads: int | None = None) -> EncoderConfig:
    """How each encoding worker process (or Ray actor) rebuilds `model` (same path, device, dtype and
    fingerprint); `threads`: torch threads of each (None: this process's shared out over `options.workers`)."""
    return EncoderConfig(
        model_path=str(options.model_path),
        device=str(model.device),
        dtype=model.dtype_name,
        seam_tokens=options.seam_tokens,
        fingerprint=model.fingerprint,
        threads_per_worker=threads if threads is not None else threads_per_worker(options.workers),
        preload_modules=("hypic_rag.runtime.engine", "hypic_rag.runtime.model", type(model.hf_model).__module__),
    )
