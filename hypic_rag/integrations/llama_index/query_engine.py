"""`HypicQueryEngine`: answers over any LlamaIndex retriever's nodes, each node its own cached segment."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from llama_index.core.base.response.schema import Response, StreamingResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import MetadataMode, NodeWithScore

from hypic_rag.integrations.llama_index.llm import HypicLLM
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.modes import check_mode
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.streaming import StrippedDeltas
from hypic_rag.usage import usage_of

__all__ = ["HypicQueryEngine"]


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
            check_mode(self.mode)

    @classmethod
    def class_name(cls) -> str:
        return "HypicQueryEngine"

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        began = time.perf_counter()
        nodes: list[NodeWithScore] = self.retriever.retrieve(query_str)
        return self._answer(query_str, nodes, began, time.perf_counter() - began)

    async def acustom_query(self, query_str: str) -> Response | StreamingResponse:
        """`custom_query` on an event loop: retrieval through the retriever's `aretrieve` and the generation
        awaited from the runtime's scheduler, so concurrent `aquery` calls batch."""
        began = time.perf_counter()
        nodes: list[NodeWithScore] = await self.retriever.aretrieve(query_str)
        retrieval_seconds = time.perf_counter() - began
        if self.streaming:
            return self._answer(query_str, nodes, began, retrieval_seconds)
        request, mode, params = self._generation_inputs(query_str, nodes)
        generation = await self.llm.runtime.agenerate(request, mode, params)
        return self._response(generation, nodes, mode, began, retrieval_seconds)

    def _generation_inputs(self, query_str: str, nodes: list[NodeWithScore]) -> tuple[Any, str, SamplingParams]:
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
        return request, mode, params

    def _answer(
        self, query_str: str, nodes: list[NodeWithScore], began: float, retrieval_seconds: float
    ) -> Response | StreamingResponse:
        runtime = self.llm.runtime
        request, mode, params = self._generation_inputs(query_str, nodes)
        if self.streaming:
            metadata: dict[str, Any] = {"mode": mode, "retrieval_seconds": retrieval_seconds}

            def generate() -> Iterator[str]:
                stripped = StrippedDeltas()
                with runtime.stream(request, mode, params) as deltas:  # stopping early stops the generation
                    for raw in deltas:
                        delta = stripped.feed(raw)
                        if delta:
                            yield delta
                generation: Generation = deltas.result
                metadata.update(usage=usage_of(generation), timings=dict(generation.timings))

            return StreamingResponse(response_gen=generate(), source_nodes=nodes, metadata=metadata)
        return self._response(runtime.generate(request, mode, params), nodes, mode, began, retrieval_seconds)

    @staticmethod
    def _response(
        generation: Generation, nodes: list[NodeWithScore], mode: str, began: float, retrieval_seconds: float
    ) -> Response:
        timings = {"retrieval": retrieval_seconds, **generation.timings}
        timings["time_to_first_token"] = retrieval_seconds + generation.time_to_first_token
        timings["total"] = time.perf_counter() - began
        return Response(
            response=generation.text.strip(),
            source_nodes=nodes,
            metadata={"mode": mode, "usage": usage_of(generation), "timings": timings,
                      "finish_reason": generation.finish_reason},
        )
