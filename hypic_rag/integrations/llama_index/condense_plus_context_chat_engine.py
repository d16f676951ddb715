"""`HypicCondensePlusContextChatEngine`: LlamaIndex's `CondensePlusContextChatEngine`, each node its own segment."""

from __future__ import annotations

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import CondensePlusContextChatEngine
from llama_index.core.chat_engine.types import AgentChatResponse

from hypic_rag.integrations.llama_index.chat_support import _SegmentChatEngine

__all__ = ["HypicCondensePlusContextChatEngine"]


class HypicCondensePlusContextChatEngine(_SegmentChatEngine, CondensePlusContextChatEngine):
    """A condense-plus-context chat engine (condense the conversation and the new message into a standalone
    question with the LLM, retrieve for it, answer with the context in the system prompt) whose answers come
    from `HypicSynthesizer`: each node its own segment, each earlier message its own cached segment.

    `from_defaults` takes LlamaIndex's options (`system_prompt`, `context_prompt`, `condense_prompt`,
    `skip_condense`, ...) and hypic-rag's `mode`, `max_new_tokens`, `metadata_mode`; an unknown one is a
    TypeError naming it. `chat` / `achat` replies carry the answer's usage and timings in `metadata`.
    """

    LLAMA_INDEX_OPTIONS = (
        "chat_history", "memory", "system_prompt", "context_prompt", "context_refine_prompt", "condense_prompt",
        "skip_condense", "node_postprocessors", "verbose",
    )

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        return self._with_usage(super().chat(message, chat_history))

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None) -> AgentChatResponse:
        return self._with_usage(await super().achat(message, chat_history))
