"""`HypicContextChatEngine`: LlamaIndex's `ContextChatEngine` with every retrieved node its own cached segment."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import ContextChatEngine
from llama_index.core.chat_engine.types import AgentChatResponse
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore

from hypic_rag.integrations.llama_index.chat_support import (
    CHAT_OPTIONS,
    chat_llm,
    checked_chat_options,
    segment_synthesizer,
)
from hypic_rag.integrations.llama_index.options import refuse_unknown_options
from hypic_rag.integrations.llama_index.synthesizer import HypicSynthesizer

__all__ = ["HypicContextChatEngine"]

LLAMA_INDEX_OPTIONS = (
    "chat_history", "memory", "system_prompt", "prefix_messages", "node_postprocessors", "context_template",
    "context_refine_template",
)


class HypicContextChatEngine(ContextChatEngine):
    """A context chat engine (retrieve for each message, answer with the context in the system prompt) whose
    answers come from `HypicSynthesizer`: each node is its own segment inside LlamaIndex's context template, each
    earlier message its own cached segment, the answer stops at its end.

        engine = HypicContextChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=4), llm=llm)
        reply = engine.chat("Who keeps bees?")      # reply.metadata: usage, timings (as a query response's)

    `from_defaults` takes LlamaIndex's options (`system_prompt`, `context_template`, `memory`,
    `node_postprocessors`, ...) and hypic-rag's `mode`, `max_new_tokens`, `metadata_mode`; an unknown one is a
    TypeError naming it. The refine template is unused (every node fits one call).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hypic_options: dict[str, Any] = {}
        self._last_synthesizer: HypicSynthesizer | None = None

    @classmethod
    def from_defaults(  # type: ignore[override]
        cls, retriever: BaseRetriever, llm: Any = None, **options: Any
    ) -> HypicContextChatEngine:
        refuse_unknown_options(f"{cls.__name__}.from_defaults", options, (*LLAMA_INDEX_OPTIONS, *CHAT_OPTIONS))
        llm = chat_llm(llm)
        hypic = checked_chat_options(llm, {key: options.pop(key) for key in CHAT_OPTIONS if key in options})
        engine = super().from_defaults(retriever, llm=llm, **options)
        engine._hypic_options = hypic
        return engine  # type: ignore[return-value]

    def _get_response_synthesizer(self, chat_history: list[ChatMessage], streaming: bool = False) -> Any:
        stock = super()._get_response_synthesizer(chat_history, streaming=streaming)
        self._last_synthesizer = segment_synthesizer(
            chat_llm(self._llm), stock, streaming, self.callback_manager, self._hypic_options
        )
        return self._last_synthesizer

    def _with_usage(self, response: AgentChatResponse) -> AgentChatResponse:
        if self._last_synthesizer is not None:
            response.metadata = self._last_synthesizer.last_metadata
        return response

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None,
             prev_chunks: list[NodeWithScore] | None = None) -> AgentChatResponse:
        return self._with_usage(super().chat(message, chat_history, prev_chunks))

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None,
                    prev_chunks: list[NodeWithScore] | None = None) -> AgentChatResponse:
        return self._with_usage(await super().achat(message, chat_history, prev_chunks))
