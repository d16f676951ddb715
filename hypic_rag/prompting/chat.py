"""Chat messages as a segmented request: documents become cached segments, the rest is rendered around them.

A message's content is a string or a list of text parts (OpenAI's `[{"type": "text", "text": ...}, ...]`); a string
is cut at the separator (`<<PIC_SEP>>` by default) into parts the same way. In a message of several parts every
part but the last is a *document*: a segment whose cache entry is computed once and reused wherever it appears, in
any request and order; the last part is the message's own text. Each document's segment is its text formatted
with the prompt format's chunk template (`"{text}\\n"` by default), so a document equal to an indexed chunk reuses
the index's entry.

Rendering: with the tokenizer's chat template (Qwen3.5 / Qwen3-Next checkpoints have one), the conversation is
rendered with a marker in place of each document and cut at the markers: the rendered text between documents (role
headers, the system prompt, earlier turns) becomes segments of its own, and everything after the last document
(the last message's text and the generation prompt) is the query, always recomputed. Without a chat template the
product's prompt format is used: its prefix, one segment per document, then the other messages' text
(`User: ...` lines) and the question template around the last message's text; generation then stops at the
format's `answer_stop` as `/v1/ask` does.

Given a `SegmentMatcher`, the text that is not a document (the rendered text around documents, the query) is cut
around the indexed chunks and seen segments it contains (`hypic_rag.prompting.matching`), so documents pasted into a message
without separators reuse their entries as well; documents sent as parts are remembered as seen segments.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hypic_rag.prompting.layout import PromptFormat
from hypic_rag.prompting.matching import Piece, SegmentedPrompt, SegmentMatcher, segment_prompt
from hypic_rag.runtime.request import Request
from hypic_rag.prompting.segments import split_segments

logger = logging.getLogger(__name__)

MARKER = "<<HYPIC_DOCUMENT_{}>>"
"""Stands for document number {} while the chat template renders the conversation."""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message: its role and its content parts (a string content is one part, or several when separated)."""

    role: str
    parts: tuple[str, ...]

    @classmethod
    def of(cls, role: str, content: str | Sequence[str] | None, separator: str) -> ChatMessage:
        """A message from OpenAI's content: a string (cut at `separator`), a list of part texts, or None."""
        if content is None:
            return cls(role, ("",))
        if isinstance(content, str):
            return cls(role, tuple(split_segments(content, separator)))
        return cls(role, tuple(content) or ("",))

    @property
    def documents(self) -> tuple[str, ...]:
        """Every part but the last, when there are several."""
        return self.parts[:-1]

    @property
    def text(self) -> str:
        """The message's own text: its last part."""
        return self.parts[-1]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation: its segments (`SegmentedPrompt`: the request, cached segments then the query, and
    which were matched), how many are documents, whether the chat template rendered it, and stop strings its
    format adds."""

    prompt: SegmentedPrompt
    documents: int
    templated: bool
    stop_strings: tuple[str, ...] = ()

    @property
    def request(self) -> Request:
        return self.prompt.request


def has_chat_template(tokenizer: object) -> bool:
    """Whether `tokenizer` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(
    tokenizer: object, messages: Sequence[ChatMessage], prompt_format: PromptFormat,
    matcher: SegmentMatcher | None = None,
) -> ChatPrompt:
    """The request of `messages`: with the tokenizer's chat template when it has one, else with `prompt_format`;
    the text around documents cut around `matcher`'s matches when one is given.

    ValueError for no messages, an empty query or text holding a lone surrogate."""
    if not messages:
        raise ValueError("messages: at least one message is required")
    if has_chat_template(tokenizer):
        return _templated(tokenizer, messages, prompt_format, matcher)
    return _formatted(tokenizer, messages, prompt_format, matcher)


def _templated(
    tokenizer: object, messages: Sequence[ChatMessage], prompt_format: PromptFormat, matcher: SegmentMatcher | None
) -> ChatPrompt:
    documents: list[str] = []
    rendered_messages = []
    for message in messages:
        markers = []
        for document in message.documents:
            markers.append(MARKER.format(len(documents)))
            documents.append(document)
        rendered_messages.append({"role": message.role, "content": "".join(markers) + message.text})
    rendered = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        rendered_messages, tokenize=False, add_generation_prompt=True
    )
    pieces: list[Piece] = []
    rest = rendered
    for number in range(len(documents)):
        marker = MARKER.format(number)
        if rest.count(marker) != 1:  # the template dropped or repeated a part: no document can be cut out
            logger.warning("the chat template does not keep content parts in place; the prompt is one query")
            plain = [{"role": m.role, "content": "".join(prompt_format.chunk(d) for d in m.documents) + m.text}
                     for m in messages]
            text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)  # type: ignore
            return ChatPrompt(segment_prompt(tokenizer, [Piece(text)], matcher=matcher), 0, True)
        before, rest = rest.split(marker, 1)
        pieces.extend([Piece(before), Piece(prompt_format.chunk(documents[number]), explicit=True)])
    pieces.append(Piece(rest))
    return ChatPrompt(segment_prompt(tokenizer, pieces, matcher=matcher), len(documents), True)


def _formatted(
    tokenizer: object, messages: Sequence[ChatMessage], prompt_format: PromptFormat, matcher: SegmentMatcher | None
) -> ChatPrompt:
    documents = [document for message in messages for document in message.documents]
    *history, last = messages
    transcript = "".join(f"{message.role.capitalize()}: {message.text.strip()}\n"
                         for message in history if message.text.strip())
    question = last.text.strip()
    if not question:
        raise ValueError("the last message's text (the question) is empty")
    pieces = [Piece(prompt_format.prefix, explicit=True),
              *(Piece(prompt_format.chunk(document), explicit=True) for document in documents),
              Piece(transcript + prompt_format.question(question))]
    prompt = segment_prompt(tokenizer, pieces, matcher=matcher, prefix=prompt_format.prefix)
    stops = (prompt_format.answer_stop,) if prompt_format.answer_stop else ()
    return ChatPrompt(prompt, len(documents), False, stops)
