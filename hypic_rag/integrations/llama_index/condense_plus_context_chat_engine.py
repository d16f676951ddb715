"""`HypicCondensePlusContextChatEngine`: LlamaIndex's `CondensePlusContextChatEngine`, each node its own segment."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.chat_engine.types import AgentChatResponse
from llama_index.core.retrievers import BaseRetriever

from hypic_rag.integrations.llama_index.chat_support import (
    CHAT_OPTIONS,
    chat_llm,
    checked_chat_options,
    segment_synthesizer,
)
from hypic_rag.integrations.llama_index.options import refuse_unknown_options
from hypic_rag.integrations.llama_index.synthesizer import HypicSynthesizer

__all__ = ["HypicCondensePlusContextChatEngine"]

LLAMA_INDEX_OPTIONS = (
    "chat_history", "memory", "system_prompt", "context_prompt", "context_refine_prompt", "condense_prompt",
    "skip_condense", "node_postprocessors", "verbose",
)


class HypicCondensePlusContextChatEngine(CondensePlusContextChatEngine):
    """A condense-plus-context chat engine (condense the conversation and the new message into a standalone
    question with the LLM, retrieve for it, answer with the context in the system prompt) whose answers come
    from `HypicSynthesizer`: each node its own segment, each earlier message its own cached segment.

    `from_defaults` takes LlamaIndex's options (`system_prompt`, `context_prompt`, `condense_prompt`,
    `skip_condense`, ...) and hypic-rag's `mode`, `max_new_tokens`, `metadata_mode`; an unknown one is a
    TypeError naming it. `chat` / `achat` replies carry the answer's usage and timings in `metadata`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hypic_options: dict[str, Any] = {}
        self._last_synthesizer: HypicSynthesizer | None = None

    @classmethod
    def from_defaults(  # type: ignore[override]
        cls, retriever: BaseRetriever, llm: Any = None, **options: Any
    ) -> HypicCondensePlusContextChatEngine:
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

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        return self._with_usage(super().chat(message, chat_history))

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        return self._with_usage(await super().achat(message, chat_history))
