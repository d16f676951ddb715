"""`HypicQueryEngine`: LlamaIndex's retriever query engine with the segment synthesizer, each node its own segment."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

from llama_index.core.base.response.schema import RESPONSE_TYPE, AsyncStreamingResponse, StreamingResponse
from llama_index.core.callbacks import CBEventType, EventPayload
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import QueryBundle

from hypic_rag.integrations.llama_index.llm import HypicLLM
from hypic_rag.integrations.llama_index.options import refuse_unknown_options
from hypic_rag.integrations.llama_index.synthesizer import OPTIONS as SYNTHESIZER_OPTIONS
from hypic_rag.integrations.llama_index.synthesizer import HypicSynthesizer

__all__ = ["HypicQueryEngine"]

ENGINE_OPTIONS = ("node_postprocessors",)
RETRIEVER_HINT = (
    "Retrieval options (similarity_top_k, filters...) belong to the retriever: "
    "HypicQueryEngine(retriever=index.as_retriever(similarity_top_k=4), ...)"
)


class HypicQueryEngine(RetrieverQueryEngine):
    """Answers with hypic-rag over the nodes any LlamaIndex retriever returns, each node its own segment.

    `HypicQueryEngine(retriever=..., llm=None, node_postprocessors=None, response_mode="compact",
    text_qa_template=None, mode=None, max_new_tokens=None, streaming=False, metadata_mode=MetadataMode.NONE,
    empty_response=None, callback_manager=None)`: a `RetrieverQueryEngine` (retrieval, then the node
    postprocessors in order, then a `HypicSynthesizer` with the remaining options; an unknown option is a
    TypeError naming it). So it sends LlamaIndex's query, retrieval, synthesis and LLM events, exposes the
    synthesizer's prompt as `response_synthesizer:text_qa_template`, and `aquery` runs the model off the event
    loop (an `AsyncStreamingResponse` when streaming). `response.metadata` holds mode, response mode, usage,
    timings (retrieval, which includes the postprocessors, added to the synthesizer's) and finish reason, beside
    LlamaIndex's per-node metadata. `llm=None` takes `Settings.llm` when it is a `HypicLLM`, else a default
    `HypicLLM()`.
    """

    def __init__(self, retriever: BaseRetriever | None = None, llm: HypicLLM | None = None, **options: Any) -> None:
        refuse_unknown_options(
            type(self).__name__, options, (*ENGINE_OPTIONS, *SYNTHESIZER_OPTIONS, "retriever"), RETRIEVER_HINT
        )
        if not isinstance(retriever, BaseRetriever):
            raise TypeError(f"retriever must be a LlamaIndex retriever (BaseRetriever), got {type(retriever).__name__}")
        if options.get("callback_manager") is None:
            from llama_index.core import Settings

            options["callback_manager"] = Settings.callback_manager
        postprocessors = options.pop("node_postprocessors", None)
        synthesizer = HypicSynthesizer(llm=llm, **options)
        super().__init__(
            retriever=retriever, response_synthesizer=synthesizer, node_postprocessors=postprocessors,
            callback_manager=options["callback_manager"],
        )

    @classmethod
    def from_args(  # type: ignore[override]
        cls, retriever: BaseRetriever, llm: Any = None, **options: Any
    ) -> HypicQueryEngine:
        """The same as the constructor (LlamaIndex's `from_args` spelling)."""
        return cls(retriever, llm, **options)

    @classmethod
    def class_name(cls) -> str:
        return "HypicQueryEngine"

    # ------------------------------------------------------------------------------------------- settings
    @property
    def response_synthesizer(self) -> HypicSynthesizer:
        return self._response_synthesizer  # type: ignore[return-value]

    @property
    def llm(self) -> HypicLLM:
        return self.response_synthesizer.llm

    @property
    def mode(self) -> str:
        return self.response_synthesizer.mode

    @property
    def max_new_tokens(self) -> int:
        return self.response_synthesizer.max_new_tokens

    @property
    def streaming(self) -> bool:
        return self.response_synthesizer.streaming

    @property
    def response_mode(self) -> str:
        return self.response_synthesizer.response_mode

    @property
    def node_postprocessors(self) -> list[Any]:
        return list(self._node_postprocessors)

    def _update_prompts(self, prompts: PromptDictType) -> None:
        own = sorted(key for key in prompts if ":" not in key)
        if own:
            raise ValueError(
                f"{type(self).__name__} has no prompt {', '.join(map(repr, own))} of its own; its prompt is its "
                "synthesizer's: 'response_synthesizer:text_qa_template'"
            )

    # ------------------------------------------------------------------------------------------- queries
    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        began = time.perf_counter()
        with self.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as query_event:
            nodes = self.retrieve(query_bundle)
            retrieval = time.perf_counter() - began
            response = self._response_synthesizer.synthesize(query=query_bundle, nodes=nodes)
            query_event.on_end(payload={EventPayload.RESPONSE: response})
        return _timed(response, retrieval, began)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        began = time.perf_counter()
        with self.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}
        ) as query_event:
            nodes = await self.aretrieve(query_bundle)
            retrieval = time.perf_counter() - began
            response = await self._response_synthesizer.asynthesize(query=query_bundle, nodes=nodes)
            query_event.on_end(payload={EventPayload.RESPONSE: response})
        return _timed(response, retrieval, began)


def _add_retrieval(metadata: dict[str, Any], retrieval: float, began: float) -> None:
    """The query's timings: retrieval first, the synthesizer's, time to first token and total from the query's
    start."""
    timings = dict(metadata.get("timings") or {})
    first = timings.get("time_to_first_token")
    timings = {"retrieval": retrieval, **timings, "total": time.perf_counter() - began}
    if first is not None:
        timings["time_to_first_token"] = retrieval + first
    metadata["timings"] = timings


def _timed(response: RESPONSE_TYPE, retrieval: float, began: float) -> RESPONSE_TYPE:
    """`response` with the retrieval time in its timings (for a stream: once it has ended)."""
    metadata = response.metadata
    if metadata is None:
        return response
    if isinstance(response, StreamingResponse) and response.response_gen is not None:
        inner = response.response_gen

        def timed() -> Generator[str, None, None]:
            yield from inner
            _add_retrieval(metadata, retrieval, began)

        response.response_gen = timed()
    elif isinstance(response, AsyncStreamingResponse):
        ainner = response.response_gen

        async def atimed() -> AsyncGenerator[str, None]:
            try:
                async for delta in ainner:
                    yield delta
            finally:
                await ainner.aclose()
            _add_retrieval(metadata, retrieval, began)

        response.response_gen = atimed()
    else:
        _add_retrieval(metadata, retrieval, began)
    return response
