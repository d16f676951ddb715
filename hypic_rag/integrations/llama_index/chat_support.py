"""What the hypic-rag chat engines share: LlamaIndex's own chat prompt, answered by `HypicSynthesizer`.

LlamaIndex's context chat engines build a fresh synthesizer for every turn from the chat so far (the system
prompt with the context template, earlier turns, the new message) and hand it the retrieved nodes. The hypic-rag
engines keep that prompt and swap the synthesizer: the nodes become one segment each where `{context_str}` is,
every earlier message its own cached segment (`layout.py`), so a node's entry and the conversation so far are
reused from turn to turn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llama_index.core.callbacks import CallbackManager
from llama_index.core.response_synthesizers import BaseSynthesizer

from hypic_rag.integrations.llama_index.llm import HypicLLM
from hypic_rag.integrations.llama_index.synthesizer import HypicSynthesizer, hypic_llm

__all__ = ["CHAT_OPTIONS", "chat_llm", "checked_chat_options", "segment_synthesizer"]

CHAT_OPTIONS = ("mode", "max_new_tokens", "metadata_mode")
"""`HypicSynthesizer` options a hypic-rag chat engine takes besides LlamaIndex's own."""


def chat_llm(llm: Any) -> HypicLLM:
    """The engine's LLM: a `HypicLLM` (None: `Settings.llm` when it is one, else the bundled model)."""
    return hypic_llm(llm)


def checked_chat_options(llm: HypicLLM, options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` (of `CHAT_OPTIONS`) once a synthesizer accepts them: bad values fail when the engine is made,
    not at its first turn."""
    HypicSynthesizer(llm=llm, **options)
    return dict(options)


def segment_synthesizer(
    llm: HypicLLM, stock: BaseSynthesizer, streaming: bool, callback_manager: CallbackManager,
    options: Mapping[str, Any],
) -> HypicSynthesizer:
    """A `HypicSynthesizer` with the question-answering prompt of `stock` (the synthesizer LlamaIndex built for
    this turn)."""
    template = stock.get_prompts()["text_qa_template"]
    return HypicSynthesizer(
        llm=llm, text_qa_template=template, streaming=streaming, callback_manager=callback_manager, **options
    )
