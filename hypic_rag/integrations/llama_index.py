"""LlamaIndex integration (llama-index-core 0.14): answer through hypic-rag with each node as its own segment.

    from llama_index.core import Settings, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from hypic_rag.integrations.llama_index import (
        HypicCacheTransformation, HypicEmbedding, HypicLLM, HypicQueryEngine)

    llm = HypicLLM(cache_dir="cache/")              # the bundled default model; segment cache on disk
    Settings.llm, Settings.embed_model = llm, HypicEmbedding()
    nodes = IngestionPipeline(transformations=[
        SentenceSplitter(chunk_size=200, chunk_overlap=0, tokenizer=llm.runtime.tokenize),
        HypicCacheTransformation(runtime=llm.runtime),   # precompute every node's cache entry
        Settings.embed_model,
    ]).run(documents=documents)
    engine = HypicQueryEngine(retriever=VectorStoreIndex(nodes).as_retriever(similarity_top_k=4), llm=llm)
    response = engine.query("Who founded the Amber Kiln studio?")   # response.source_nodes: the retrieved nodes

- `HypicQueryEngine` takes any retriever and passes each retrieved node's text to the runtime as its own segment
  (never one concatenated string), so a node's cached entry is reused wherever it lands in a prompt.
- `HypicLLM` is a LlamaIndex LLM for `Settings.llm`: plain completion (a prompt whose segments are separated by
  `<<PIC_SEP>>` reuses each segment's cache entry; the last segment is the query) and chat (each earlier message
  is its own cached segment).
- `HypicCacheTransformation` is an ingestion step that encodes every node's segment-cache entry ahead of queries.
- `HypicEmbedding` wraps the shipped all-MiniLM-L6-v2 sentence-transformers model (offline) as an embed model.
All of them share one `HypicRuntime` (model, engine, cache) per model and cache directory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import (
        ChatMessage,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
    )
    from llama_index.core.base.response.schema import Response, StreamingResponse
    from llama_index.core.bridge.pydantic import Field, PrivateAttr
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, TransformComponent
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hypic_rag.integrations.llama_index needs llama-index-core 0.14: install it with "
        "`pip install 'hypic-rag[llamaindex]'` (or `pip install 'llama-index-core>=0.14,<0.15'`)"
    ) from error

from hypic_rag.prompt import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.runtime.engine import Engine, PrefillStats
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.modes import MODES
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SEED_MAX, SamplingParams
from hypic_rag.server.accounting import usage_of
from hypic_rag.server.config import DEFAULT_SEPARATOR
from hypic_rag.server.segments import segmented_request, split_segments
from hypic_rag.streaming import ResultStream, StrippedDeltas
from hypic_rag.text import unencodable_message

logger = logging.getLogger(__name__)

DEFAULT_SEAM_TOKENS = 8
PRECOMPUTE_BATCH = 8


# ==================================================================================================== runtime
class HypicRuntime:
    """A model, its engine and segment cache (persistent in `cache_dir`, else in memory), shared by the LLM, the
    query engine and the ingestion transformation. The engine is not thread-safe: one lock serialises its use
    (a streaming generation holds it until the stream is consumed or closed)."""

    _shared: dict[tuple[str, str | None, int, str | None], HypicRuntime] = {}
    _shared_lock = threading.Lock()

    def __init__(
        self, engine: Engine, *, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT, model_path: str = ""
    ) -> None:
        if engine.model.tokenizer is None:
            raise ValueError("the model has no tokenizer; hypic-rag's LlamaIndex integration needs one")
        self.engine = engine
        self.prompt_format = prompt_format
        self.model_path = model_path
        self.lock = threading.RLock()

    @classmethod
    def open(
        cls,
        model_path: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        seam_tokens: int = DEFAULT_SEAM_TOKENS,
        device: str | None = None,
        prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT,
    ) -> HypicRuntime:
        """Load a model (None: the bundled default model) and open `cache_dir` as its segment cache."""
        from hypic_rag.runtime.model import load_model

        path = resolve_model_path(model_path)
        model = load_model(path, device=device)
        cache = None
        if cache_dir is not None:
            from hypic_rag.cache.keys import CacheNamespace
            from hypic_rag.cache.segment_cache import SegmentCache

            namespace = CacheNamespace.for_model(model, seam_tokens)
            cache = SegmentCache.open(Path(cache_dir).expanduser(), namespace=namespace)
        return cls(Engine(model, seam_tokens=seam_tokens, segment_source=cache), prompt_format=prompt_format,
                   model_path=str(path))

    @classmethod
    def shared(
        cls,
        model_path: str | Path | None = None,
        *,
        cache_dir: str | Path | None = None,
        seam_tokens: int = DEFAULT_SEAM_TOKENS,
        device: str | None = None,
    ) -> HypicRuntime:
        """One runtime per (model, cache directory, seam width, device) in this process, opened on first use
        (a cache directory can be open only once per process)."""
        key = (
            str(resolve_model_path(model_path).resolve()),
            str(Path(cache_dir).expanduser().resolve()) if cache_dir is not None else None,
            seam_tokens,
            device,
        )
        with cls._shared_lock:
            runtime = cls._shared.get(key)
            if runtime is None:
                runtime = cls.open(key[0], cache_dir=key[1], seam_tokens=seam_tokens, device=device)
                cls._shared[key] = runtime
            return runtime

    def close(self) -> None:
        """Close the segment cache (if any) and forget this runtime in the shared registry."""
        with self._shared_lock:
            for key, runtime in list(self._shared.items()):
                if runtime is self:
                    del self._shared[key]
        with self.lock:
            self.engine.segment_source.close()

    # ------------------------------------------------------------------------------------------- tokens
    @property
    def tokenizer(self) -> Any:
        return self.engine.model.tokenizer

    @property
    def model_name(self) -> str:
        return Path(self.model_path).name or "hypic-rag"

    @property
    def context_window(self) -> int:
        config = self.engine.model.config
        text_config = getattr(config, "text_config", None) or config
        return int(getattr(text_config, "max_position_embeddings", 4096))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` alone (no special tokens); usable as a LlamaIndex splitter's `tokenizer`.
        ValueError when `text` holds a lone surrogate."""
        message = unencodable_message(text, "the text")
        if message is not None:
            raise ValueError(message)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def chunk_ids(self, text: str) -> list[int]:
        """Token ids of `text` formatted as a retrieved-chunk segment (what the query engine composes)."""
        return self.tokenize(self.prompt_format.chunk(text))

    def rag_request(self, texts: Sequence[str], question: str) -> Request:
        """The prompt prefix, one segment per text, then the question, each tokenized on its own."""
        question = question.strip()
        if not question:
            raise ValueError("the question is empty")
        return Request(
            prefix_ids=self.tokenize(self.prompt_format.prefix),
            chunk_ids=[ids for ids in (self.chunk_ids(text) for text in texts) if ids],
            question_ids=self.tokenize(self.prompt_format.question(question)),
        )

    # ------------------------------------------------------------------------------------------- work
    def precompute(self, segments: Sequence[Sequence[int]], *, include_prefix: bool = False) -> PrefillStats:
        """Make sure the cache holds the entries hypic mode will ask for: each chunk segment's (for the seam width)
        and, with `include_prefix`, the prompt prefix's. Missing ones are encoded and stored; hits and misses are
        counted."""
        stats = PrefillStats(mode="hypic")
        prefix = self.tokenize(self.prompt_format.prefix) if include_prefix else []
        with self.lock:
            if prefix:  # a prefill of the prefix alone fetches (or stores) exactly the entry queries will use
                warmed = self.engine.prefill(Request(prefix, [], prefix[-1:]), "hypic").stats
                stats.cache_hits += warmed.cache_hits
                stats.cache_misses += warmed.cache_misses
            for start in range(0, len(segments), PRECOMPUTE_BATCH):
                batch = [list(ids) for ids in segments[start : start + PRECOMPUTE_BATCH] if ids]
                if batch:
                    self.engine.fetch_entries(batch, self.engine.seam_tokens, stats)
        return stats

    def generate(self, request: Request, mode: str, params: SamplingParams) -> Generation:
        with self.lock:
            return self.engine.generate(request, mode, params)

    def stream(self, request: Request, mode: str, params: SamplingParams) -> ResultStream[str, Generation]:
        """Non-empty text deltas as they are generated, the runtime's lock held until the stream ends or is
        closed; its `.result` is the `Generation`."""

        def deltas() -> Generator[str, None, Generation]:
            with self.lock, self.engine.stream(request, mode, params) as inner:
                for _, delta in inner:
                    if delta:
                        yield delta
                return inner.result

        return ResultStream(deltas())


def resolve_model_path(model_path: str | Path | None) -> Path:
    """`model_path`, or the bundled default model; FileNotFoundError when neither exists."""
    from hypic_rag.default_model import resolve_model_path as resolve

    return resolve(model_path)


def _checked_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    return mode


def _runtime_for(runtime: HypicRuntime | None, model_path: str | None, cache_dir: str | None, seam_tokens: int,
                 device: str | None) -> HypicRuntime:
    return runtime if runtime is not None else HypicRuntime.shared(
        model_path, cache_dir=cache_dir, seam_tokens=seam_tokens, device=device
    )


# ==================================================================================================== embeddings
class HypicEmbedding(BaseEmbedding):
    """The shipped all-MiniLM-L6-v2 sentence-transformers model (or any local one) as a LlamaIndex embed model.

    Offline: nothing is downloaded. Vectors are L2-normalised (inner product is cosine similarity).
    """

    model_path: str | None = Field(
        default=None, description="A local sentence-transformers directory; None: the shipped all-MiniLM-L6-v2."
    )
    _embedder: Any = PrivateAttr()

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        from hypic_rag.retrieval.embeddings import DEFAULT_EMBEDDER_NAME, SentenceEmbedder

        embedder = SentenceEmbedder(model_path)
        kwargs.setdefault("model_name", DEFAULT_EMBEDDER_NAME if model_path is None else Path(model_path).name)
        super().__init__(model_path=model_path, **kwargs)
        self._embedder = embedder

    @classmethod
    def class_name(cls) -> str:
        return "HypicEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embedder.embed_query(query).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embedder.embed(texts).tolist()


# ==================================================================================================== LLM
def segmented_messages_to_prompt(messages: Sequence[ChatMessage], separator: str = DEFAULT_SEPARATOR) -> str:
    """Chat messages as separated segments: every message is its own (cached) segment; the last one, followed by
    the assistant's turn, is the query."""
    parts = [f"{message.role.value}: {message.content or ''}\n" for message in messages]
    if not parts:
        raise ValueError("no messages given")
    parts[-1] += "assistant:"
    return separator.join(parts)


class HypicLLM(CustomLLM):
    """A LlamaIndex LLM that generates with hypic-rag (the bundled default model unless `model_path`).

    `complete(prompt)`: segments of the prompt separated by `separator` are cached and reused wherever they land;
    the last segment is the query. `chat(messages)`: each earlier message is its own cached segment. Usage
    (prompt, cached, recomputed and completion tokens) is in `CompletionResponse.additional_kwargs`.
    """

    model_path: str | None = Field(default=None, description="Checkpoint directory; None: the bundled default model.")
    cache_dir: str | None = Field(default=None, description="Segment cache directory; None: an in-memory cache.")
    seam_tokens: int = Field(default=DEFAULT_SEAM_TOKENS, ge=0, description="Seam window recomputed per segment.")
    device: str | None = Field(default=None, description="cpu or cuda (None: cuda when available).")
    mode: str = Field(default="hypic", description="Assembly mode: hypic, transition_rope, ..., full.")
    max_new_tokens: int = Field(default=64, gt=0, description="Most tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="0 is greedy.")
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX,
        description="Makes sampling reproducible (0 to 2**64 - 1); None: every call samples afresh.",
    )
    separator: str = Field(default=DEFAULT_SEPARATOR, min_length=1, description="What separates prompt segments.")
    _runtime: HypicRuntime = PrivateAttr()

    def __init__(self, *, runtime: HypicRuntime | None = None, **kwargs: Any) -> None:
        separator = kwargs.get("separator", DEFAULT_SEPARATOR)
        kwargs.setdefault("messages_to_prompt", partial(segmented_messages_to_prompt, separator=separator))
        super().__init__(**kwargs)
        _checked_mode(self.mode)
        self._runtime = _runtime_for(runtime, self.model_path, self.cache_dir, self.seam_tokens, self.device)

    @classmethod
    def class_name(cls) -> str:
        return "HypicLLM"

    @property
    def runtime(self) -> HypicRuntime:
        return self._runtime

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._runtime.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=self._runtime.model_name,
        )

    def sampling(self, **kwargs: Any) -> SamplingParams:
        """Sampling for one call: `max_new_tokens` (or `max_tokens`), `temperature`, `seed`, `stop` override the
        fields. Without a seed, sampling (temperature > 0) draws fresh randomness on every call."""
        stop = kwargs.get("stop") or ()
        return SamplingParams(
            max_new_tokens=int(kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))),
            temperature=float(kwargs.get("temperature", self.temperature)),
            seed=kwargs.get("seed", self.seed),
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
        )

    def _request(self, prompt: str, formatted: bool) -> Request:
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        return segmented_request(self._runtime.tokenizer, split_segments(prompt, self.separator))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        mode = _checked_mode(kwargs.get("mode", self.mode))
        generation = self._runtime.generate(self._request(prompt, formatted), mode, self.sampling(**kwargs))
        return CompletionResponse(
            text=generation.text,
            additional_kwargs={**usage_of(generation), "finish_reason": generation.finish_reason, "mode": mode},
            raw={"timings": dict(generation.timings)},
        )

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        mode = _checked_mode(kwargs.get("mode", self.mode))
        request = self._request(prompt, formatted)
        params = self.sampling(**kwargs)

        def generate() -> CompletionResponseGen:
            text = ""
            for delta in self._runtime.stream(request, mode, params):
                text += delta
                yield CompletionResponse(text=text, delta=delta)

        return generate()


# ==================================================================================================== query engine
class HypicQueryEngine(CustomQueryEngine):
    """Answers with hypic-rag over the nodes any LlamaIndex retriever returns, each node its own segment.

    The prompt is hypic-rag's RAG layout: the fixed prefix, one segment per retrieved node (its text, metadata
    left out, in retrieval order), then the question. Returns a `Response` (or `StreamingResponse` with
    `streaming=True`) whose `source_nodes` are the retrieved nodes and whose `metadata` holds usage and timings.
    The answer is stripped of surrounding whitespace, and so is the stream: its deltas add up to the answer.
    """

    retriever: BaseRetriever = Field(description="Any retriever, e.g. VectorStoreIndex.as_retriever().")
    llm: HypicLLM = Field(description="The hypic-rag LLM that generates (its runtime holds the cache).")
    mode: str | None = Field(default=None, description="Assembly mode; None: the LLM's.")
    max_new_tokens: int | None = Field(default=None, gt=0, description="Answer length cap; None: the LLM's.")
    streaming: bool = Field(default=False, description="Return a StreamingResponse.")

    def __init__(self, *, retriever: BaseRetriever, llm: HypicLLM | None = None, **kwargs: Any) -> None:
        if llm is None:
            from llama_index.core import Settings

            llm = Settings.llm if isinstance(Settings.llm, HypicLLM) else HypicLLM()
        super().__init__(retriever=retriever, llm=llm, **kwargs)
        if self.mode is not None:
            _checked_mode(self.mode)

    @classmethod
    def class_name(cls) -> str:
        return "HypicQueryEngine"

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        began = time.perf_counter()
        nodes: list[NodeWithScore] = self.retriever.retrieve(query_str)
        retrieval_seconds = time.perf_counter() - began
        runtime = self.llm.runtime
        texts = [item.node.get_content(metadata_mode=MetadataMode.NONE) for item in nodes]
        request = runtime.rag_request(texts, query_str)
        mode = self.mode or self.llm.mode
        params = SamplingParams(
            max_new_tokens=self.max_new_tokens or self.llm.max_new_tokens,
            temperature=self.llm.temperature,
            seed=self.llm.seed,
            stop_strings=(runtime.prompt_format.answer_stop,) if runtime.prompt_format.answer_stop else (),
        )
        if self.streaming:
            metadata: dict[str, Any] = {"mode": mode, "retrieval_seconds": retrieval_seconds}

            def generate() -> Iterator[str]:
                stripped = StrippedDeltas()
                with runtime.stream(request, mode, params) as deltas:  # stopping early releases the lock now
                    for raw in deltas:
                        delta = stripped.feed(raw)
                        if delta:
                            yield delta
                generation: Generation = deltas.result
                metadata.update(usage=usage_of(generation), timings=dict(generation.timings))

            return StreamingResponse(response_gen=generate(), source_nodes=nodes, metadata=metadata)
        generation = runtime.generate(request, mode, params)
        timings = {"retrieval": retrieval_seconds, **generation.timings}
        timings["time_to_first_token"] = retrieval_seconds + generation.time_to_first_token
        timings["total"] = time.perf_counter() - began
        return Response(
            response=generation.text.strip(),
            source_nodes=nodes,
            metadata={"mode": mode, "usage": usage_of(generation), "timings": timings,
                      "finish_reason": generation.finish_reason},
        )


# ==================================================================================================== ingestion
class HypicCacheTransformation(TransformComponent):
    """An `IngestionPipeline` step that encodes every node's segment-cache entry ahead of queries.

    Place it after the node parser. Each node's text (metadata left out) is formatted as a retrieved-chunk
    segment, exactly as `HypicQueryEngine` lays it out, so queries find its entry; the prompt prefix is encoded
    too. Nodes pass through unchanged
    but for `metadata[metadata_key]` (the segment's token count), hidden from embeddings and the LLM.
    """

    model_path: str | None = Field(default=None, description="Checkpoint directory; None: the bundled default model.")
    cache_dir: str | None = Field(default=None, description="Segment cache directory; None: the in-memory cache.")
    seam_tokens: int = Field(default=DEFAULT_SEAM_TOKENS, ge=0, description="Seam window the entries are made for.")
    device: str | None = Field(default=None, description="cpu or cuda (None: cuda when available).")
    metadata_key: str = Field(default="hypic_segment_tokens", description="Node metadata key of the token count.")
    _runtime: HypicRuntime = PrivateAttr()
    _last_stats: PrefillStats | None = PrivateAttr(default=None)

    def __init__(self, *, runtime: HypicRuntime | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._runtime = _runtime_for(runtime, self.model_path, self.cache_dir, self.seam_tokens, self.device)

    @classmethod
    def class_name(cls) -> str:
        return "HypicCacheTransformation"

    @property
    def runtime(self) -> HypicRuntime:
        return self._runtime

    @property
    def last_stats(self) -> PrefillStats | None:
        """Segments of the last call (its nodes and the prompt prefix) already cached (hits) or encoded (misses)."""
        return self._last_stats

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        segments = []
        for node in nodes:
            ids = self._runtime.chunk_ids(node.get_content(metadata_mode=MetadataMode.NONE))
            segments.append(ids)
            node.metadata[self.metadata_key] = len(ids)
            for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
                if self.metadata_key not in excluded:
                    excluded.append(self.metadata_key)
        began = time.perf_counter()
        self._last_stats = self._runtime.precompute(segments, include_prefix=True)
        logger.info(
            "segment cache: %d nodes and the prompt prefix, %d already cached, %d encoded in %.2f s",
            len(segments), self._last_stats.cache_hits, self._last_stats.cache_misses, time.perf_counter() - began,
        )
        return nodes


__all__ = [
    "HypicCacheTransformation",
    "HypicEmbedding",
    "HypicLLM",
    "HypicQueryEngine",
    "HypicRuntime",
    "segmented_messages_to_prompt",
]
