"""What the hypic-rag chat engines share: LlamaIndex's own chat prompt, answered by `HypicSynthesizer`.

LlamaIndex's context chat engines build a fresh synthesizer for every turn from the chat so far (the system
prompt with the context template, earlier turns, the new message) and hand it the retrieved nodes. The hypic-rag
engines keep that prompt and swap the synthesizer: the nodes become one segment each where `{context_str}` is,
every earlier message its own cached segment (`layout.py`), so a node's entry and the conversation so far are
reused from turn to turn.
"""

from __future__ import annotations

from typing import Any, Self

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.chat_engine.types import AgentChatResponse
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.retrievers import BaseRetriever

from hypic_rag.integrations.llama_index.options import refuse_unknown_options
from hypic_rag.integrations.llama_index.synthesizer import HypicSynthesizer, hypic_llm

__all__ = ["CHAT_OPTIONS"]

CHAT_OPTIONS = ("mode", "max_new_tokens", "metadata_mode")
"""`HypicSynthesizer` options a hypic-rag chat engine takes besides LlamaIndex's own."""


class _SegmentChatEngine:
    """What a hypic-rag chat engine adds to a LlamaIndex context chat engine (the class after it in the bases):
    `from_defaults` also takes `CHAT_OPTIONS` (checked when the engine is made, not at its first turn) and refuses
    what neither takes; every turn's synthesizer is a `HypicSynthesizer` with the question-answering prompt of the
    one LlamaIndex built; `_with_usage` gives a reply the answer's usage and timings as its `metadata`."""

    LLAMA_INDEX_OPTIONS: tuple[str, ...] = ()
    """The `from_defaults` options of the LlamaIndex engine this one extends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hypic_options: dict[str, Any] = {}
        self._last_synthesizer: HypicSynthesizer | None = None

    @classmethod
    def from_defaults(cls, retriever: BaseRetriever, llm: Any = None, **options: Any) -> Self:
        refuse_unknown_options(f"{cls.__name__}.from_defaults", options, (*cls.LLAMA_INDEX_OPTIONS, *CHAT_OPTIONS))
        llm = hypic_llm(llm)
        hypic = {key: options.pop(key) for key in CHAT_OPTIONS if key in options}
        HypicSynthesizer(llm=llm, **hypic)  # bad values fail here
        engine = super().from_defaults(retriever, llm=llm, **options)  # type: ignore[misc]
        engine._hypic_options = hypic
        return engine

    def _get_response_synthesizer(self, chat_history: list[ChatMessage], streaming: bool = False) -> Any:
        stock: BaseSynthesizer = super()._get_response_synthesizer(  # type: ignore[misc]
            chat_history, streaming=streaming
        )
        self._last_synthesizer = HypicSynthesizer(
            llm=hypic_llm(self._llm), text_qa_template=stock.get_prompts()["text_qa_template"], streaming=streaming,
            callback_manager=self.callback_manager, **self._hypic_options,
        )
        return self._last_synthesizer

    def _with_usage(self, response: AgentChatResponse) -> AgentChatResponse:
        if self._last_synthesizer is not None:
            response.metadata = self._last_synthesizer.last_metadata
        return response
