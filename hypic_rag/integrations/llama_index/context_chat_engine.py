"""`HypicContextChatEngine`: LlamaIndex's `ContextChatEngine` with every retrieved node its own cached segment."""

from __future__ import annotations

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine import ContextChatEngine
from llama_index.core.chat_engine.types import AgentChatResponse
from llama_index.core.schema import NodeWithScore

from hypic_rag.integrations.llama_index.chat_support import _SegmentChatEngine

__all__ = ["HypicContextChatEngine"]


class HypicContextChatEngine(_SegmentChatEngine, ContextChatEngine):
    """A context chat engine (retrieve for each message, answer with the context in the system prompt) whose
    answers come from `HypicSynthesizer`: each node is its own segment inside LlamaIndex's context template, each
    earlier message its own cached segment, the answer stops at its end.

        engine = HypicContextChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=4), llm=llm)
        reply = engine.chat("Who keeps bees?")      # reply.metadata: usage, timings (as a query response's)

    `from_defaults` takes LlamaIndex's options (`system_prompt`, `context_template`, `memory`,
    `node_postprocessors`, ...) and hypic-rag's `mode`, `max_new_tokens`, `metadata_mode`; an unknown one is a
    TypeError naming it. The refine template is unused (every node fits one call).
    """

    LLAMA_INDEX_OPTIONS = (
        "chat_history", "memory", "system_prompt", "prefix_messages", "node_postprocessors", "context_template",
        "context_refine_template",
    )

    def chat(self, message: str, chat_history: list[ChatMessage] | None = None,
             prev_chunks: list[NodeWithScore] | None = None) -> AgentChatResponse:
        return self._with_usage(super().chat(message, chat_history, prev_chunks))

    async def achat(self, message: str, chat_history: list[ChatMessage] | None = None,
                    prev_chunks: list[NodeWithScore] | None = None) -> AgentChatResponse:
        return self._with_usage(await super().achat(message, chat_history, prev_chunks))
