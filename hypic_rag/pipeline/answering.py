"""Question answering over an index: retrieve chunks, assemble their cached segments, generate.

One `RagPipeline` serves the CLI's `ask` and `demo` and the REST service: an opened index and the
`session.ModelSession` it was built for (model, engine, segment cache, the index's whole prompt format). Retrieved
chunks are passed to the runtime as separate segments (their stored token ids), never as one concatenated string.
Answers are generated through the session's scheduler, the model's one (`ModelSession.scheduler`), as every way in
generates: `stream` steps it in the caller's thread; the service's model worker drives the same scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypic_rag.demo.world import DEMO_MODEL_NOTE, WorldCheck, is_bundled_model
from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.utils.limits import MAX_QUESTION_CHARS, question_problem
from hypic_rag.prompting.layout import PromptFormat
from hypic_rag.runtime.assembly import Assembly
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.generation import Generation, GenerationStream, PrefillStats
from hypic_rag.runtime.modes import check_mode
from hypic_rag.runtime.recompute_policy import RecomputePolicy, as_policy
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.pipeline.session import CacheConfig, ModelSession
from hypic_rag.utils.streaming import ResultStream, StrippedDeltas
from hypic_rag.pipeline.vocabulary import prompt_part_record, source_record

if TYPE_CHECKING:
    from hypic_rag.cache.remote_config import RemoteTierConfig

logger = logging.getLogger(__name__)


class PipelineError(HypicError, ValueError):
    """A request the pipeline cannot serve (bad question, wrong model for the index, ...): exit code 2; still a
    ValueError."""

    exit_code = EXIT_BAD_INPUT


@dataclass(slots=True)
class Source:
    """A retrieved chunk shown as a source of the answer.

    score: cosine similarity to the question. metadata: the document's fields and the chunk's location (`page`,
    `page_end`, `section`). hop_query: for a chunk found by the retrieval hop, the follow-up query that found it
    (None for a direct hit), and hop_score its similarity to that query. neighbour_of: for a chunk brought by the
    index's neighbour expansion (`SearchHit.neighbour_of`), the chunk id of the retrieved chunk of its document that
    brought it (None for a chunk retrieved by its own similarity). As JSON: `vocabulary.source_record`.
    """

    doc_id: str
    chunk_id: str
    score: float
    text: str
    source: str = ""
    position: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    hop_query: str | None = None
    hop_score: float | None = None
    neighbour_of: str | None = None


@dataclass(slots=True)
class Answer:
    """recompute_policy: the spec of the policy a `hypic` answer was assembled with ("" in other modes). note: a
    line the reader should see beside the answer, else None: `hypic_rag.demo.world.DEMO_MODEL_NOTE` when the bundled
    demo model answered over chunks outside its synthetic world. prompt_parts: the prompt part by part, in prompt
    order, with what each recomputed and reused (`vocabulary.prompt_part_record`; empty where no prompt was laid
    out from the index)."""

    text: str
    sources: list[Source]
    mode: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    token_ids: list[int] = field(default_factory=list)
    recompute_policy: str = ""
    note: str | None = None
    prompt_parts: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "answer": self.text,
            "sources": [source_record(source, rank) for rank, source in enumerate(self.sources, start=1)],
            "mode": self.mode,
            "recompute_policy": self.recompute_policy,
            "finish_reason": self.finish_reason,
            "usage": dict(self.usage),
            "timings": dict(self.timings),
            "note": self.note,
            "prompt_parts": [dict(part) for part in self.prompt_parts],
        }


@dataclass(frozen=True, slots=True)
class Question:
    """A question to answer over the index: its text, how many chunks to retrieve, the assembly mode and what a
    `hypic` answer recomputes (None: the session's policy)."""

    text: str
    top_k: int = 8
    mode: str = "hypic"
    policy: RecomputePolicy | str | None = None


@dataclass(slots=True)
class PreparedQuestion:
    """A question retrieved for and laid out (`RagPipeline.prepare`): its sources (best first), its request, the
    retrieval time, when preparing began (an answer's timings count from there), the recompute policy a `hypic`
    answer uses (the session's when the caller named none) and the ids of its chunks in prompt order (retrieval
    order; the sources are best first)."""

    mode: str
    sources: list[Source]
    request: Request
    retrieval_seconds: float
    began: float
    policy: RecomputePolicy | None = None
    prompt_chunk_ids: list[str] = field(default_factory=list)

    @property
    def assembly(self) -> Assembly:
        """How its request is assembled: its mode and recompute policy (the seam window: the session's)."""
        return Assembly(self.mode, policy=self.policy)


class RagPipeline:
    """Answers questions over an index: `RagPipeline.open(index_dir)`, then `answer(question)` (an `Answer`: text,
    sources, usage, timings) or `stream(question)`; `close()` (or a `with` block) closes its cache and index.

    index: a `hypic_rag.retrieval.corpus_index.CorpusIndex` opened for search; session: a `ModelSession` whose
    model is the one the index was built for (its tokenizer made the chunks' token ids), normally with the
    index's prompt format (`ModelSession.for_index`); hop_slots: how many of the top_k places go to one retrieval
    hop from the best hit (`CorpusIndex.search`; 0 turns the hop off); max_question_chars: the longest question
    answered (`hypic_rag.utils.limits.MAX_QUESTION_CHARS`, as on every surface; a server passes its own)."""

    def __init__(self, index: Any, session: ModelSession, *, hop_slots: int = 2,
                 max_question_chars: int = MAX_QUESTION_CHARS) -> None:
        if hop_slots < 0:
            raise PipelineError("hop_slots must be >= 0")
        if max_question_chars < 1:
            raise PipelineError("max_question_chars must be >= 1")
        from hypic_rag.retrieval.errors import IndexMismatchError

        try:
            index.manifest.check_loaded_model(index.manifest.model.path, session.model)
        except IndexMismatchError as error:
            raise PipelineError(f"index {index.directory}: {error}") from None
        self.index = index
        self.session = session
        self.hop_slots = hop_slots
        self.max_question_chars = max_question_chars
        self.open_timings: dict[str, float] = {}
        """Seconds `open` took to load the model (`model_load`), open the index (`index_open`) and load the
        embedder (`embedder_load`); empty for a pipeline built from an opened index and session."""
        self.world_check = WorldCheck(session.tokenizer) if is_bundled_model(session.model_path) else None
        """For the bundled demo model: tells chunks outside its synthetic world (`note_for`); None otherwise."""

    def note_for(self, sources: Sequence[Source]) -> str | None:
        """`DEMO_MODEL_NOTE` when the bundled demo model answers over this index and the index (as precompute
        measured it) or one of `sources` (documents added later) lies outside its world; else None."""
        if self.world_check is None:
            return None
        fit = self.index.manifest.corpus_fit
        if fit is not None and not fit.in_world:
            return DEMO_MODEL_NOTE
        return DEMO_MODEL_NOTE if any(self.world_check.is_foreign(source.text) for source in sources) else None

    @property
    def engine(self) -> Engine:
        return self.session.engine

    @property
    def tokenizer(self) -> Any:
        return self.session.tokenizer

    @property
    def prompt_format(self) -> PromptFormat:
        return self.session.prompt_format

    @classmethod
    def open(
        cls, index_dir: str | Path, *, model_path: str | Path | None = None, embedder_path: str | Path | None = None,
        seam_tokens: int | None = None, device: str | None = None, hot_budget_bytes: int | None = None,
        readonly_cache: bool = False, hop_slots: int = 2, dtype: str | None = None,
        remote_cache: RemoteTierConfig | None = None, recompute_policy: RecomputePolicy | str | None = None,
        cache_format: str | None = None, neighbours: str | None = None,
    ) -> RagPipeline:
        """Open an index and the session it was built for (`ModelSession.for_index`: its model, the one recorded
        in the manifest unless `model_path`, in the dtype recorded there unless `dtype`, checked against the
        manifest: another model or dtype raises `IndexMismatchError`; its prompt format; its segment cache; its
        recorded recompute policy unless `recompute_policy`), and its embedder (loaded now, so the first question's
        timing is the question's). A model directory that cannot be loaded raises `ModelLoadError`, a bad policy
        spec `RecomputePolicyError`. remote_cache: the shared remote tier below the segment cache
        (`hypic_rag.cache.remote_config.RemoteTierConfig`; None: none). cache_format: the cache format expected
        (None: the index's; another than the index's raises `IndexMismatchError`, docs/cache.md). neighbours: the
        neighbour expansion of every search (`KIND:SLOTS`, `hypic_rag.retrieval.chunk_context`; None: the
        index's)."""
        policy = as_policy(recompute_policy)
        from hypic_rag.retrieval.corpus_index import CorpusIndex
        from hypic_rag.retrieval.manifest import IndexManifest

        index_dir = Path(index_dir).expanduser()
        manifest = IndexManifest.load(index_dir)
        model_path = Path(model_path).expanduser() if model_path else Path(manifest.model.path)
        if not (model_path / "config.json").is_file():
            raise PipelineError(f"model directory {str(model_path)!r} does not exist or has no config.json; pass --model")
        # best effort: a damaged cache is disabled (warned), a failed write is logged; answers go on
        cache = CacheConfig(readonly=readonly_cache, best_effort=True, hot_budget_bytes=hot_budget_bytes,
                             remote=remote_cache, cache_format=cache_format)
        began = time.perf_counter()
        session = ModelSession.for_index(
            manifest, index_dir, model_path=model_path, device=device, dtype=dtype, seam_tokens=seam_tokens,
            cache=cache, recompute_policy=policy,
        )
        timings = {"model_load": time.perf_counter() - began}
        try:
            began = time.perf_counter()
            index = CorpusIndex.open(index_dir, embedder_path=embedder_path, neighbours=neighbours)
            timings["index_open"] = time.perf_counter() - began
        except BaseException:
            session.close()
            raise
        try:
            began = time.perf_counter()
            index.embedder.load()
            timings["embedder_load"] = time.perf_counter() - began
            pipeline = cls(index, session, hop_slots=hop_slots)
            pipeline.open_timings = timings
            return pipeline
        except BaseException:
            session.close()
            index.close()
            raise

    def close(self) -> None:
        self.session.close()
        self.index.close()

    def __enter__(self) -> RagPipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------------------

    def request_for(
        self, question: str, chunk_token_ids: list[list[int]], from_hop: Sequence[bool] = (), *, tokenizer: Any = None,
        follows: Sequence[bool] = (),
    ) -> Request:
        """The request of `question` over chunks given as token ids of their formatted segments
        (`ModelSession.request`; tokenizer: the session's unless given), its chunks ranked for recompute policies by
        `retrieval_ranks(from_hop)` (prompt order when `from_hop` is empty) and marked with `follows`
        (`Request.chunk_follows`, see `chunk_follows`); `PipelineError` for an empty question or one holding a lone
        surrogate."""
        try:
            request = self.session.request(question, chunk_token_ids, tokenizer=tokenizer)
        except ValueError as error:
            raise PipelineError(str(error)) from None
        if from_hop and len(from_hop) == len(request.chunk_ids):
            request.chunk_ranks = retrieval_ranks(from_hop)
        if any(follows) and len(follows) == len(request.chunk_ids):
            request.chunk_follows = list(follows)
        return request

    def stream(
        self, question: str, *, top_k: int = 8, mode: str = "hypic", params: SamplingParams | None = None,
        check: Callable[[], None] | None = None, policy: RecomputePolicy | str | None = None,
    ) -> ResultStream[tuple[str, Any], Answer]:
        """A stream of ("sources", [Source]) first (best first by similarity to the question), then ("token", text_delta) items; its `.result` is the `Answer`.

        Nothing runs until the stream is iterated. The answer is the generated text stripped of surrounding
        whitespace, and so is the stream: its deltas add up exactly to `Answer.text` (leading whitespace is
        dropped, trailing whitespace held until more text follows; a delta may be ""). check: runs before every
        step and before each segment the prefill encodes (a deadline, a cancellation); raising stops it there.
        policy: what a `hypic` answer recomputes (None: the session's, i.e. the index's recorded policy or the one
        the pipeline was opened with; `runtime.recompute_policy`).
        """
        return ResultStream(self._answer_steps(question, top_k, mode, params, check, as_policy(policy)), check=check)

    def _answer_steps(
        self, question: str, top_k: int, mode: str, params: SamplingParams | None, check: Callable[[], None] | None,
        policy: RecomputePolicy | None = None,
    ) -> Generator[tuple[str, Any], None, Answer]:
        params = params or self.default_params()
        prepared = self.prepare(question, top_k=top_k, mode=mode, policy=policy)
        yield "sources", prepared.sources
        generation: Generation = yield from _relay(
            self.session.scheduler.stream(prepared.request, prepared.assembly, params, check=check)
        )
        return self.answer_of(prepared, generation)

    def default_params(self) -> SamplingParams:
        """An answer's sampling when none is given: greedy, 48 tokens, stopping at the format's answer stop."""
        return SamplingParams(max_new_tokens=48, stop_strings=(self.prompt_format.answer_stop,))

    def prepare(
        self, question: str, *, top_k: int = 8, mode: str = "hypic", policy: RecomputePolicy | str | None = None
    ) -> PreparedQuestion:
        """Retrieve `top_k` chunks for `question` and build its request (what generation needs; `answer_of`
        turns the generation into the `Answer`). policy: what a `hypic` answer recomputes (None: the session's);
        resolved into `PreparedQuestion.policy`. `PipelineError` for a bad question, mode or top_k. One question
        is `prepare_many` of one."""
        prepared = self.prepare_many([Question(question, top_k, mode, policy)])[0]
        if isinstance(prepared, Exception):
            raise prepared
        return prepared

    def prepare_many(
        self, questions: Sequence[Question], *, tokenizer: Any = None
    ) -> list[PreparedQuestion | Exception]:
        """`prepare` of every question, their retrieval batched: the questions are embedded in one call and
        searched together (`CorpusIndex.search_many`, the retrieval hop's follow-ups too), so each gets the chunks
        and request it gets alone. A question that cannot be prepared gets its error in its place (`PipelineError`,
        `UnknownModeError`, `RecomputePolicyError`), the others go on. tokenizer: what tokenizes the questions
        (None: the session's; a thread other than the session's owner passes its own copy)."""
        began = time.perf_counter()
        results: list[PreparedQuestion | Exception | None] = [None] * len(questions)
        valid: list[tuple[int, str, RecomputePolicy]] = []
        for number, asked in enumerate(questions):
            try:
                check_mode(asked.mode)
                policy = as_policy(asked.policy) or self.session.recompute_policy
                problem = question_problem(asked.text, self.max_question_chars)
                if problem is not None:
                    raise PipelineError(f"the question {problem}")
                if asked.top_k < 1:
                    raise PipelineError("top_k must be >= 1")
            except ValueError as error:
                results[number] = error
                continue
            valid.append((number, asked.text.strip(), policy))
        if valid:
            self._retrieve(questions, valid, results, began, tokenizer)
        return [result for result in results if result is not None]

    def _retrieve(self, questions: Sequence[Question], valid: list[tuple[int, str, RecomputePolicy]],
                  results: list[PreparedQuestion | Exception | None], began: float, tokenizer: Any = None) -> None:
        """Fill `results[number]` for every valid question (number, stripped text, policy): one batched search."""
        found = self.index.search_many([text for _, text, _ in valid], [questions[n].top_k for n, _, _ in valid],
                                       hop_slots=self.hop_slots)
        retrieval_seconds = time.perf_counter() - began
        for (number, text, policy), hits in zip(valid, found):
            sources = sorted((_source_of(hit) for hit in hits), key=lambda source: -source.score)  # the prompt
            # keeps retrieval order (direct hits, then the hop's, whose scores against the question are lower)
            hits = prompt_order(hits)
            try:
                request = self.request_for(text, [list(hit.chunk.token_ids) for hit in hits],
                                           [hit.hop_query is not None for hit in hits], tokenizer=tokenizer,
                                           follows=chunk_follows(hits))
            except PipelineError as error:
                results[number] = error
                continue
            results[number] = PreparedQuestion(questions[number].mode, sources, request, retrieval_seconds, began,
                                               policy, [hit.chunk.chunk_id for hit in hits])

    def answer_of(self, prepared: PreparedQuestion, generation: Generation) -> Answer:
        """The `Answer` of a prepared question once its generation has ended (the text stripped)."""
        timings = {"retrieval": prepared.retrieval_seconds, **generation.timings}
        timings["time_to_first_token"] = prepared.retrieval_seconds + generation.time_to_first_token
        timings["total"] = time.perf_counter() - prepared.began
        label = _policy_label(prepared.policy, self.session.seam_tokens) if prepared.mode == "hypic" else ""
        return Answer(generation.text.strip(), prepared.sources, prepared.mode, generation.finish_reason,
                      generation.usage(), timings, generation.token_ids, label, self.note_for(prepared.sources),
                      prompt_parts(prepared.request, generation.prefill, prepared.prompt_chunk_ids))

    def answer(
        self, question: str, *, top_k: int = 8, mode: str = "hypic", params: SamplingParams | None = None,
        on_token: Callable[[str], None] | None = None, policy: RecomputePolicy | str | None = None,
    ) -> Answer:
        """Retrieve `top_k` chunks, assemble under `mode` (and `policy`, see `stream`), generate; the answer with
        sources, usage and timings."""

        def forward(item: tuple[str, Any]) -> None:
            if item[0] == "token" and on_token is not None:
                on_token(item[1])

        return self.stream(question, top_k=top_k, mode=mode, params=params, policy=policy).run(forward)


def prompt_parts(request: Request, prefill: PrefillStats, chunk_ids: Sequence[str]) -> list[dict[str, Any]]:
    """`request`'s prompt part by part (`vocabulary.prompt_part_record`): its prefix (when it has one), its chunks
    (named by `chunk_ids`, prompt order), its question; what each recomputed and reused, from `prefill`."""
    kinds = (["prefix"] if request.prefix_ids else []) + ["chunk"] * len(request.chunk_ids)
    names: list[str | None] = [None] * (len(kinds) - len(request.chunk_ids)) + list(chunk_ids)
    if len(names) != len(kinds):
        raise ValueError(f"{len(chunk_ids)} chunk ids for {len(request.chunk_ids)} chunks")
    parts = [prompt_part_record(kind, name, len(segment), recomputed, reused)
             for kind, name, segment, recomputed, reused in zip(kinds, names, request.segments,
                                                                 prefill.segment_recomputed_tokens,
                                                                 prefill.segment_reused_tokens, strict=True)]
    question = len(request.question_ids)
    return [*parts, prompt_part_record("question", None, question, question, 0)]


def _policy_label(policy: Any, seam_tokens: int) -> str:
    """The spec of `policy` with its seam made explicit (`whole:1@8`), or its text for a custom rule."""
    return policy.resolved(seam_tokens).spec if isinstance(policy, RecomputePolicy) else str(policy)


def prompt_order(hits: Sequence[Any]) -> list[Any]:
    """The retrieved hits (`SearchHit`s, retrieval order: direct hits best first, then the hop's) in the order the
    prompt lays them out: the chunks of one document together and in document order (`chunk.position`), at the
    place of that document's first hit; documents in the order of their first hits. A document cut into several
    chunks reads as written (chunk j right after chunk j-1 when both are retrieved); hits of distinct documents
    keep retrieval order."""
    groups: dict[str, list[Any]] = {}
    for hit in hits:
        groups.setdefault(hit.chunk.doc_id, []).append(hit)
    return [hit for group in groups.values() for hit in sorted(group, key=lambda hit: hit.chunk.position)]


def chunk_follows(hits: Sequence[Any]) -> list[bool]:
    """For hits in prompt order (`prompt_order`): whether hit i is the next chunk of hit i-1's document (same
    `chunk.doc_id`, `chunk.position` one more), what a chained recompute policy reads (`Request.chunk_follows`)."""
    return follows_of([(hit.chunk.doc_id, hit.chunk.position) for hit in hits],
                      [(hit.chunk.doc_id, hit.chunk.position - 1) for hit in hits])


def follows_of(chunk_keys: Sequence[Hashable], previous_keys: Sequence[Hashable | None]) -> list[bool]:
    """Whether chunk i is the next chunk of chunk i-1's document: the chunk before chunk i in its document
    (`previous_keys[i]`, None for a document's first chunk) is chunk i-1 (`chunk_keys[i - 1]`). A key names one
    chunk: (document id, position) in the pipeline's index, the node id in LlamaIndex."""
    return [number > 0 and previous_keys[number] is not None and previous_keys[number] == chunk_keys[number - 1]
            for number in range(len(chunk_keys))]


def retrieval_ranks(from_hop: Sequence[bool]) -> list[int]:
    """How much each retrieved chunk matters to a recompute policy (0 = most), from whether the retrieval hop found
    it (`from_hop[i]`, chunks in prompt order): direct hits and hop hits alternately, each in its own order
    (best direct hit, first hop hit, second direct hit, ...). A two-hop question's second document is a hop hit,
    so a policy that recomputes the top two chunks recomputes both of its documents
    (docs/recompute_policies.md measures this against the other rankings)."""
    direct = [number for number, hop in enumerate(from_hop) if not hop]
    hops = [number for number, hop in enumerate(from_hop) if hop]
    order: list[int] = []
    for position in range(max(len(direct), len(hops))):
        order.extend(group[position] for group in (direct, hops) if position < len(group))
    ranks = [0] * len(from_hop)
    for rank, number in enumerate(order):
        ranks[number] = rank
    return ranks


def _source_of(hit: Any) -> Source:
    chunk = hit.chunk
    return Source(chunk.doc_id, chunk.chunk_id, hit.score, chunk.text, chunk.source, chunk.position, dict(chunk.metadata),
                  hit.hop_query, hit.hop_score, hit.neighbour_of)


def _relay(inner: GenerationStream) -> Generator[tuple[str, str], None, Generation]:
    """Re-yield an engine stream as ("token", delta) items, stripped as the answer is (`StrippedDeltas`), and
    return its `Generation`."""
    stripped = StrippedDeltas()
    with inner:  # closed with the outer stream when that stops early
        for _, delta in inner:
            yield "token", stripped.feed(delta)
    return inner.result
