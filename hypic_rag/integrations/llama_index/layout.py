"""A LlamaIndex prompt template cut into hypic-rag segments: the retrieved nodes go where `{context_str}` is.

    template = default_qa_template(runtime.prompt_format)   # prefix + "{context_str}" + "Question: {query_str}..."
    head, tail = template_pieces(template, query="Who keeps bees?")
    request = segmented_request(runtime, head, [runtime.prompt_format.chunk(text) for text in texts], tail)

The template is rendered with markers for `{context_str}` and `{query_str}`. Text before the context (`head`)
is cached: its first piece is the prompt prefix segment, any further piece (a chat template's later messages)
its own segment. Each node is one segment, formatted with the runtime's chunk template exactly as the ingestion
transformation encodes it, so the entries precomputed at ingestion are the ones reused. Text after the context
(`tail`) holds the question: its last piece is the query segment (recomputed every call), earlier pieces (chat
history messages) are cached segments. A chat template (`ChatPromptTemplate`) is laid out as `HypicLLM.chat`
lays out messages, one piece per message. The default template reproduces hypic-rag's own RAG layout
(`ModelSession.request`) token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate, SelectorPromptTemplate
from llama_index.core.prompts.prompt_type import PromptType

from hypic_rag.integrations.llama_index.llm import segmented_messages_to_prompt
from hypic_rag.prompting.layout import PromptFormat, tokenize_query
from hypic_rag.runtime.request import Request
from hypic_rag.pipeline.session import ModelSession

__all__ = ["check_template", "default_qa_template", "prompt_text", "segmented_request", "template_pieces"]

CONTEXT = "context_str"
QUERY = "query_str"
_CONTEXT_MARK = "\x00hypic-rag:context\x00"
_QUERY_MARK = "\x00hypic-rag:query\x00"
_PIECE_MARK = "\x00hypic-rag:piece\x00"


def default_qa_template(prompt_format: PromptFormat) -> PromptTemplate:
    """The question-answering template of `prompt_format`: its prefix, the nodes, its question template."""
    question = prompt_format.question_template.replace("{question}", "{" + QUERY + "}")
    return PromptTemplate(prompt_format.prefix + "{" + CONTEXT + "}" + question, prompt_type=PromptType.QUESTION_ANSWER)


def _rendered_pieces(template: BasePromptTemplate) -> list[str]:
    """The template rendered with markers for the context and the query, cut into its pieces (one for a text
    template; one per message for a chat template)."""
    if isinstance(template, SelectorPromptTemplate):
        template = template.default_template
    marks = {CONTEXT: _CONTEXT_MARK, QUERY: _QUERY_MARK}
    if isinstance(template, ChatPromptTemplate):
        messages = template.format_messages(**marks)
        return segmented_messages_to_prompt(messages, _PIECE_MARK).split(_PIECE_MARK)
    if isinstance(template, PromptTemplate):
        return [template.format(**marks)]
    raise TypeError(
        f"a hypic-rag prompt template must be a PromptTemplate or ChatPromptTemplate, got {type(template).__name__}"
    )


def _cut(template: BasePromptTemplate) -> tuple[list[str], list[str]]:
    """(head, tail) pieces around the context marker; ValueError unless the template has `{context_str}` once
    and `{query_str}` only after it."""
    pieces = _rendered_pieces(template)
    contexts = sum(piece.count(_CONTEXT_MARK) for piece in pieces)
    if contexts != 1:
        raise ValueError(
            "the prompt template must contain {context_str} exactly once (the retrieved nodes go there, each its "
            f"own cached segment); found it {contexts} times"
        )
    where = next(index for index, piece in enumerate(pieces) if _CONTEXT_MARK in piece)
    before, after = pieces[where].split(_CONTEXT_MARK)
    head, tail = [*pieces[:where], before], [after, *pieces[where + 1:]]
    if any(_QUERY_MARK in piece for piece in head):
        raise ValueError(
            "the prompt template must not put {query_str} before {context_str}: the text before the nodes is "
            "cached as the prompt prefix, so it cannot hold the question"
        )
    if not any(_QUERY_MARK in piece for piece in tail):
        raise ValueError("the prompt template must contain {query_str} (after {context_str})")
    return head, tail


def check_template(template: BasePromptTemplate) -> BasePromptTemplate:
    """`template` when hypic-rag can lay it out as segments (see the module's docstring), else ValueError (or
    TypeError for a template kind it does not know)."""
    _cut(template)
    return template


def template_pieces(template: BasePromptTemplate, query: str) -> tuple[list[str], list[str]]:
    """(head, tail): the non-empty text pieces before and after the nodes, the stripped `query` in the tail.
    ValueError when the query is empty."""
    query = query.strip()
    if not query:
        raise ValueError("the question is empty")
    head, tail = _cut(template)
    tail = [piece.replace(_QUERY_MARK, query) for piece in tail]
    return [piece for piece in head if piece], [piece for piece in tail if piece]


def segmented_request(
    session: ModelSession, head: Sequence[str], chunks: Sequence[str], tail: Sequence[str]
) -> Request:
    """The request of `head` pieces (the first one the prefix), `chunks` (formatted segments, one per node) and
    `tail` pieces (the last one the question), each tokenized on its own; empty segments are dropped.
    ValueError when a piece holds a lone surrogate."""
    prefix = session.tokenize_segment(head[0], "the prompt prefix") if head else []
    middle = [*head[1:], *chunks, *tail[:-1]]
    segments = [session.tokenize_segment(text, "a prompt segment") for text in middle]
    question, answer_lead = tokenize_query(session.tokenizer, tail[-1], "the question")
    return Request(prefix_ids=prefix, chunk_ids=[ids for ids in segments if ids], question_ids=question,
                   answer_lead=answer_lead)


def prompt_text(head: Sequence[str], chunks: Sequence[str], tail: Sequence[str]) -> str:
    """The prompt as the model reads it: every segment's text in order."""
    return "".join([*head, *chunks, *tail])
