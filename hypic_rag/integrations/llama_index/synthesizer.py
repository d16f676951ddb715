"""`HypicSynthesizer`: a LlamaIndex response synthesizer that hands every node to hypic-rag as its own segment.

    engine = index.as_query_engine(response_synthesizer=HypicSynthesizer(llm=llm))
    engine = RetrieverQueryEngine(retriever, response_synthesizer=HypicSynthesizer(llm=llm, streaming=True))

Each node's text (metadata left out unless `metadata_mode` says otherwise) is formatted with the runtime's chunk
template, exactly as `HypicCacheTransformation` encodes it, so the entries precomputed at ingestion (or left by
an earlier query) are reused wherever the node lands in the prompt. The prompt is the `text_qa_template` (by
default hypic-rag's own RAG layout; see `layout.py` for how a template is cut into segments). Answers stop at
the prompt format's answer stop and are stripped; `response.metadata` holds the usage and timings beside
LlamaIndex's per-node metadata. Every model call sends LlamaIndex's LLM events (`events.py`), and the async
paths run the model in worker threads (`aio.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.synthesis import SynthesizeEndEvent, SynthesizeStartEvent
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixinType
from llama_index.core.response_synthesizers import BaseSynthesizer, ResponseMode
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, QueryType, TextNode
from llama_index.core.types import RESPONSE_TEXT_TYPE

from hypic_rag.integrations.llama_index.aio import in_thread, relay_stream
from hypic_rag.integrations.llama_index.events import completion_events, completion_response
from hypic_rag.integrations.llama_index.layout import (
    check_template,
    default_qa_template,
    document_order,
    node_follows,
    prompt_text,
    segmented_request,
    template_pieces,
)
from hypic_rag.integrations.llama_index.llm import HypicLLM
from hypic_rag.integrations.llama_index.options import refuse_unknown_options
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.modes import check_mode
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.utils.streaming import StrippedDeltas
from hypic_rag.pipeline.usage import usage_of
from hypic_rag.pipeline.vocabulary import USAGE_FIELDS

__all__ = ["SUPPORTED_RESPONSE_MODES", "HypicSynthesizer", "check_response_mode", "hypic_llm"]

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

SUPPORTED_RESPONSE_MODES = ("compact", "simple_summarize", "accumulate", "no_text")
"""compact and simple_summarize: one call, every node its own segment (LlamaIndex's compact packs nodes into as
few calls as the context window allows: with segments, all of them fit one call); accumulate: one call per node,
the answers joined as LlamaIndex's Accumulate joins them; no_text: retrieve only, no call."""
ACCUMULATE_SEPARATOR = "\n---------------------\n"
OPTIONS = (
    "llm", "response_mode", "text_qa_template", "mode", "max_new_tokens", "streaming", "metadata_mode",
    "empty_response", "callback_manager",
)


def hypic_llm(llm: Any = None) -> HypicLLM:
    """`llm` when it is a `HypicLLM`; None: `Settings.llm` when that is one, else a default `HypicLLM()` (the
    bundled model). TypeError for any other LLM (hypic-rag composes segments only through its own runtime)."""
    if llm is None:
        from llama_index.core import Settings

        current = Settings._llm  # not Settings.llm, which would build LlamaIndex's default (OpenAI) LLM
        return current if isinstance(current, HypicLLM) else HypicLLM()
    if not isinstance(llm, HypicLLM):
        raise TypeError(f"llm must be a HypicLLM (its runtime holds the segment cache), got {type(llm).__name__}")
    return llm


def check_response_mode(response_mode: Any, streaming: bool) -> str:
    """The response mode's name; ValueError naming the supported ones for any other (refine, tree_summarize...)
    and for accumulate with streaming (as LlamaIndex's Accumulate)."""
    name = response_mode.value if isinstance(response_mode, ResponseMode) else str(response_mode)
    if name not in SUPPORTED_RESPONSE_MODES:
        known = {mode.value for mode in ResponseMode}
        what = "LlamaIndex response mode" if name in known else "response mode"
        raise ValueError(
            f"{what} {name!r} is not supported by hypic-rag's segment synthesizer; supported: "
            f"{', '.join(SUPPORTED_RESPONSE_MODES)} (refine, tree_summarize and compact_accumulate chain further "
            "calls over rewritten text; compact answers over every node, each its own cached segment, in one call)"
        )
    if name == "accumulate" and streaming:
        raise ValueError("response mode 'accumulate' cannot stream (one answer per node); use compact to stream")
    return name


@dataclass(frozen=True, slots=True)
class _Call:
    """One model call: the text pieces before the nodes, the formatted nodes, the pieces after (question last), and
    per node whether it is the next chunk of the node before it in its document (`layout.node_follows`)."""

    head: list[str]
    chunks: list[str]
    tail: list[str]
    follows: list[bool]

    @property
    def prompt(self) -> str:
        return prompt_text(self.head, self.chunks, self.tail)


class HypicSynthesizer(BaseSynthesizer):
    """Answers over nodes with hypic-rag, each node its own cached segment (a LlamaIndex `BaseSynthesizer`).

    Options (keyword only; an unknown one is a TypeError naming it): `llm` (a `HypicLLM`; None: `Settings.llm`
    when it is one, else the bundled model), `response_mode` (`SUPPORTED_RESPONSE_MODES`; others are a
    ValueError), `text_qa_template` (a `PromptTemplate` or `ChatPromptTemplate` with `{context_str}` once and
    `{query_str}` after it; None: hypic-rag's RAG layout), `mode` (assembly mode; None: the LLM's),
    `max_new_tokens` (None: the LLM's), `streaming`, `metadata_mode` (how a node's text is taken; `NONE`, the
    default, matches `HypicCacheTransformation`), `empty_response` (the answer when there are no nodes),
    `callback_manager`. Sampling (temperature, seed) is the LLM's. Its prompt is `get_prompts()
    ["text_qa_template"]`; `update_prompts` changes it.
    """

    def __init__(self, llm: Any = None, **options: Any) -> None:
        refuse_unknown_options(type(self).__name__, {**options, "llm": llm}, OPTIONS)
        llm = hypic_llm(llm)
        streaming = bool(options.get("streaming", False))
        self._response_mode = check_response_mode(options.get("response_mode", ResponseMode.COMPACT), streaming)
        mode = options.get("mode")
        self._mode = check_mode(mode) if mode is not None else None
        max_new_tokens = options.get("max_new_tokens")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or int(max_new_tokens) < 1):
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self._max_new_tokens = None if max_new_tokens is None else int(max_new_tokens)
        self._metadata_mode = MetadataMode(options.get("metadata_mode", MetadataMode.NONE))
        template = options.get("text_qa_template")
        self._text_qa_template = check_template(template or default_qa_template(llm.runtime.prompt_format))
        # LlamaIndex's synthesizers also hand their callback manager to the (shared) LLM; this one sends the LLM
        # events itself, so the LLM is left as it is
        super().__init__(llm=llm, streaming=streaming, empty_response=options.get("empty_response"))
        if options.get("callback_manager") is not None:
            self._callback_manager = options["callback_manager"]
        self.last_metadata: dict[str, Any] | None = None
        """The metadata of the last response (for a stream, complete once it has ended)."""

    # ------------------------------------------------------------------------------------------- settings
    @property
    def callback_manager(self) -> CallbackManager:
        return self._callback_manager

    @callback_manager.setter
    def callback_manager(self, callback_manager: CallbackManager) -> None:
        """Where this synthesizer's synthesize and LLM events go (the LLM's own callback manager is left alone)."""
        self._callback_manager = callback_manager

    @property
    def llm(self) -> HypicLLM:
        return self._llm  # type: ignore[return-value]

    @property
    def mode(self) -> str:
        """The assembly mode calls run under (the LLM's unless set here)."""
        return self._mode or self.llm.mode

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens or self.llm.max_new_tokens

    @property
    def streaming(self) -> bool:
        return self._streaming

    @property
    def response_mode(self) -> str:
        return self._response_mode

    @property
    def metadata_mode(self) -> MetadataMode:
        return self._metadata_mode

    def sampling(self) -> SamplingParams:
        """The LLM's temperature and seed, this synthesizer's answer length, stopping at the answer's end."""
        stop = self.llm.runtime.prompt_format.answer_stop
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.llm.temperature, seed=self.llm.seed,
            stop_strings=(stop,) if stop else (),
        )

    # ------------------------------------------------------------------------------------------- prompts
    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template}

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        own = {key: value for key, value in prompts.items() if ":" not in key}
        unknown = sorted(set(own) - {"text_qa_template"})
        if unknown:
            raise ValueError(f"{type(self).__name__} has no prompt {', '.join(map(repr, unknown))}; its prompt is "
                             "'text_qa_template'")
        if "text_qa_template" in own:
            self._text_qa_template = check_template(own["text_qa_template"])

    @property
    def text_qa_template(self) -> BasePromptTemplate:
        return self._text_qa_template

    # ------------------------------------------------------------------------------------------- calls
    def _calls(self, query_str: str, nodes: Sequence[NodeWithScore]) -> list[_Call]:
        """The model calls the response mode makes over these nodes."""
        head, tail = template_pieces(self._text_qa_template, query_str)
        if self._response_mode == "no_text":
            return []
        if self._response_mode == "accumulate":
            chunks = [self.llm.runtime.prompt_format.chunk(text) for text in self._texts(nodes)]
            return [_Call(head, [chunk], tail, [False]) for chunk in chunks]
        nodes = document_order(nodes)  # a document's nodes together, as written (the pipeline's `prompt_order`)
        chunks = [self.llm.runtime.prompt_format.chunk(text) for text in self._texts(nodes)]
        return [_Call(head, chunks, tail, node_follows([item.node for item in nodes]))]

    def _request(self, call: _Call) -> Request:
        runtime = self.llm.runtime
        with runtime.lock:  # the tokenizer is shared with the generating thread
            return segmented_request(runtime, call.head, call.chunks, call.tail, follows=call.follows)

    def _options(self) -> dict[str, Any]:
        params = self.sampling()
        return {"mode": self.mode, "max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                "seed": params.seed, "stop": list(params.stop_strings)}

    def _events(self, call: _Call) -> Any:
        events = completion_events(self.llm, self._callback_manager, call.prompt, self._options())
        events.start()
        return events

    def _generate(self, request: Request) -> Generation:
        return self.llm.runtime.generate(request, self.mode, self.sampling())

    def _finish(self, events: Any, generation: Generation) -> str:
        text = generation.text.strip()
        events.end(completion_response(text, usage_of(generation), finish_reason=generation.finish_reason,
                                       mode=self.mode))
        return text

    def _answer(self, call: _Call) -> tuple[str, Generation]:
        events = self._events(call)
        try:
            generation = self._generate(self._request(call))
        except BaseException as error:
            events.fail(error)
            raise
        return self._finish(events, generation), generation

    async def _aanswer(self, call: _Call) -> tuple[str, Generation]:
        events = self._events(call)
        try:
            request = await in_thread(self._request, call)  # waits for the lock off the event loop
            generation = await self.llm.runtime.agenerate(request, self.mode, self.sampling())  # batched
        except BaseException as error:
            events.fail(error)
            raise
        return self._finish(events, generation), generation

    def _deltas(self, call: _Call, request: Request, events: Any, metadata: dict[str, Any], began: float
                ) -> Generator[str, None, None]:
        """The stripped answer's deltas; at the end the usage and timings go into `metadata` and the LLM end
        event is sent."""
        stripped, text = StrippedDeltas(), ""
        try:
            with self.llm.runtime.stream(request, self.mode, self.sampling()) as deltas:  # closing early unlocks
                for raw in deltas:
                    delta = stripped.feed(raw)
                    if delta:
                        text += delta
                        events.progress(text, delta)
                        yield delta
            generation: Generation = deltas.result
        except GeneratorExit:
            raise
        except BaseException as error:
            events.fail(error)
            raise
        metadata.update(self._call_metadata([generation], began))
        events.end(completion_response(text, usage_of(generation), finish_reason=generation.finish_reason,
                                       mode=self.mode))

    # ------------------------------------------------------------------------------------------- responses
    def _metadata(self, nodes: Sequence[NodeWithScore]) -> dict[str, Any]:
        metadata: dict[str, Any] = dict(self._get_metadata_for_response([item.node for item in nodes]) or {})
        metadata.update(mode=self.mode, response_mode=self._response_mode)
        return metadata

    def _call_metadata(self, generations: Sequence[Generation], began: float) -> dict[str, Any]:
        """Usage (summed over the calls), timings (summed; time to first token: the first call's, from the
        start of synthesis; total), finish reason (the last call's) and the number of calls."""
        usage = dict.fromkeys(USAGE_FIELDS, 0)  # all 0 when no call was made
        timings: dict[str, float] = {}
        for generation in generations:
            for key, value in usage_of(generation).items():
                usage[key] = usage.get(key, 0) + value
            for key, seconds in generation.timings.items():
                timings[key] = timings.get(key, 0.0) + seconds
        if generations:
            timings["time_to_first_token"] = generations[0].time_to_first_token
        timings["total"] = time.perf_counter() - began
        finish = generations[-1].finish_reason if generations else None
        return {"usage": usage, "timings": timings, "finish_reason": finish, "calls": len(generations)}

    def _joined(self, answers: Sequence[str]) -> str:
        if self._response_mode == "accumulate":
            return ACCUMULATE_SEPARATOR.join(f"Response {number + 1}: {answer or self._empty_response}"
                                             for number, answer in enumerate(answers))
        return answers[0] if answers else ""

    def _texts(self, nodes: Sequence[NodeWithScore]) -> list[str]:
        return [item.node.get_content(metadata_mode=self._metadata_mode) for item in nodes]

    def _respond(self, query_str: str, nodes: Sequence[NodeWithScore], sources: list[NodeWithScore]) -> RESPONSE_TYPE:
        began = time.perf_counter()
        metadata = self._metadata(sources)
        calls = self._calls(query_str, nodes)
        if self._streaming and calls:
            call = calls[0]
            request = self._request(call)
            events = self._events(call)
            return StreamingResponse(self._deltas(call, request, events, metadata, began), sources, metadata)
        answers, generations = [], []
        for call in calls:
            answer, generation = self._answer(call)
            answers.append(answer)
            generations.append(generation)
        metadata.update(self._call_metadata(generations, began))
        if self._streaming:  # no_text
            return StreamingResponse(_no_deltas(), sources, metadata)
        return Response(self._joined(answers), sources, metadata)

    async def _arespond(self, query_str: str, nodes: Sequence[NodeWithScore], sources: list[NodeWithScore]
                        ) -> RESPONSE_TYPE:
        began = time.perf_counter()
        metadata = self._metadata(sources)
        calls = self._calls(query_str, nodes)
        if self._streaming and calls:
            call = calls[0]
            request = await in_thread(self._request, call)
            events = self._events(call)
            stream = relay_stream(lambda: self._deltas(call, request, events, metadata, began))
            return AsyncStreamingResponse(stream, sources, metadata)
        answers, generations = [], []
        for call in calls:
            answer, generation = await self._aanswer(call)
            answers.append(answer)
            generations.append(generation)
        metadata.update(self._call_metadata(generations, began))
        if self._streaming:  # no_text
            return AsyncStreamingResponse(_no_adeltas(), sources, metadata)
        return Response(self._joined(answers), sources, metadata)

    def _empty(self, sources: list[NodeWithScore], asynchronous: bool) -> RESPONSE_TYPE:
        """LlamaIndex's answer when there are no nodes: `empty_response`, no call."""
        metadata = {**self._metadata(sources), **self._call_metadata([], time.perf_counter())}
        if not self._streaming:
            return Response(self._empty_response, sources, metadata)
        if asynchronous:
            return AsyncStreamingResponse(self._empty_response_agenerator(), sources, metadata)
        return StreamingResponse(self._empty_response_generator(), sources, metadata)

    # ------------------------------------------------------------------------------------------- LlamaIndex API
    def synthesize(
        self, query: QueryType, nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """The answer over `nodes`, each its own segment; `source_nodes`: `nodes` then `additional_source_nodes`.
        Sends LlamaIndex's synthesize events (and an LLM start/end pair per model call)."""
        refuse_unknown_options(f"{type(self).__name__}.synthesize", response_kwargs, ())
        bundle = query if isinstance(query, QueryBundle) else QueryBundle(query_str=str(query))
        dispatcher.event(SynthesizeStartEvent(query=bundle))
        sources = [*nodes, *(additional_source_nodes or [])]
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            response = self._respond(bundle.query_str, nodes, sources) if nodes else self._empty(sources, False)
            event.on_end(payload={EventPayload.RESPONSE: response})
        self.last_metadata = response.metadata
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    async def asynthesize(
        self, query: QueryType, nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None, **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        """`synthesize` without blocking the event loop: the model runs in a worker thread; with streaming the
        response is an `AsyncStreamingResponse` (`async_response_gen()`)."""
        refuse_unknown_options(f"{type(self).__name__}.asynthesize", response_kwargs, ())
        bundle = query if isinstance(query, QueryBundle) else QueryBundle(query_str=str(query))
        dispatcher.event(SynthesizeStartEvent(query=bundle))
        sources = [*nodes, *(additional_source_nodes or [])]
        with self._callback_manager.event(CBEventType.SYNTHESIZE,
                                          payload={EventPayload.QUERY_STR: bundle.query_str}) as event:
            if nodes:
                response = await self._arespond(bundle.query_str, nodes, sources)
            else:
                response = self._empty(sources, True)
            event.on_end(payload={EventPayload.RESPONSE: response})
        self.last_metadata = response.metadata
        dispatcher.event(SynthesizeEndEvent(query=bundle, response=response))
        return response

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any) -> RESPONSE_TEXT_TYPE:
        """The answer over plain texts, each its own segment (a string, or a generator of deltas when
        streaming)."""
        refuse_unknown_options(f"{type(self).__name__}.get_response", response_kwargs, ())
        nodes = [NodeWithScore(node=_text_node(text)) for text in text_chunks]
        response = self._respond(query_str, nodes, nodes)
        return response.response_gen if isinstance(response, StreamingResponse) else str(response.response)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
                            ) -> RESPONSE_TEXT_TYPE:
        refuse_unknown_options(f"{type(self).__name__}.aget_response", response_kwargs, ())
        nodes = [NodeWithScore(node=_text_node(text)) for text in text_chunks]
        response = await self._arespond(query_str, nodes, nodes)
        return response.response_gen if isinstance(response, AsyncStreamingResponse) else str(response.response)


def _text_node(text: str) -> TextNode:
    return TextNode(text=text)


def _no_deltas() -> Generator[str, None, None]:
    yield from ()


async def _no_adeltas() -> AsyncGenerator[str, None]:
    for delta in ():
        yield delta
