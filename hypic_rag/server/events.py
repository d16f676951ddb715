"""The events a request's output is made of, pushed into its `channel.EventChannel` by whoever produces it."""

from __future__ import annotations

from dataclasses import dataclass

from hypic_rag.pipeline.answering import Source


@dataclass(frozen=True, slots=True)
class SourcesEvent:
    """The chunks retrieved for a question, best first (sent before its first token)."""

    sources: list[Source]


@dataclass(frozen=True, slots=True)
class TextEvent:
    """A piece of generated text of choice number `choice` (0 when there is one)."""

    text: str
    choice: int = 0


Event = SourcesEvent | TextEvent
