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
from typing import Any

from llama_index.core.prompts import BasePromptTemplate, ChatPromptTemplate, PromptTemplate, SelectorPromptTemplate
from llama_index.core.prompts.prompt_type import PromptType
from llama_index.core.schema import BaseNode

from hypic_rag.integrations.llama_index.llm import segmented_messages_to_prompt
from hypic_rag.pipeline.answering import follows_of
from hypic_rag.prompting.layout import PromptFormat, tokenize_query
from hypic_rag.runtime.request import Request
from hypic_rag.pipeline.session import ModelSession

__all__ = ["check_template", "default_qa_template", "document_order", "node_follows", "prompt_text",
           "segmented_request", "template_pieces"]

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
    session: ModelSession, head: Sequence[str], chunks: Sequence[str], tail: Sequence[str], *,
    follows: Sequence[bool] = (),
) -> Request:
    """The request of `head` pieces (the first one the prefix), `chunks` (formatted segments, one per node) and
    `tail` pieces (the last one the question), each tokenized on its own; empty segments are dropped. follows: per
    chunk, whether it is the next chunk of the chunk before it in its document (`node_follows`; empty: none is),
    set on the request's chunks as `Request.chunk_follows` (what a chained recompute policy reads).
    ValueError when a piece holds a lone surrogate."""
    prefix = session.tokenize_segment(head[0], "the prompt prefix") if head else []
    middle = [*head[1:], *chunks, *tail[:-1]]
    flags = [*([False] * len(head[1:])), *(follows or [False] * len(chunks)), *([False] * len(tail[:-1]))]
    if len(flags) != len(middle):
        raise ValueError(f"{len(follows)} follows flags for {len(chunks)} chunks")
    segments = [(session.tokenize_segment(text, "a prompt segment"), flag) for text, flag in zip(middle, flags)]
    kept, previous_kept = [], True
    for ids, flag in segments:
        if ids:  # a chunk follows only the chunk right before it in the prompt
            kept.append((ids, flag and previous_kept))
        previous_kept = bool(ids)
    question, answer_lead = tokenize_query(session.tokenizer, tail[-1], "the question")
    chunk_follows = [flag for _, flag in kept]
    return Request(prefix_ids=prefix, chunk_ids=[ids for ids, _ in kept], question_ids=question,
                   answer_lead=answer_lead, chunk_follows=chunk_follows if any(chunk_follows) else [])


def document_order(nodes: Sequence[Any]) -> list[Any]:
    """The nodes (`NodeWithScore`s or nodes) as the prompt lays them out, the rule of the pipeline's `prompt_order`:
    the nodes of one source document (`ref_doc_id`, LlamaIndex's SOURCE relationship; a node without one is its
    own document) together, in document order, at the place of that document's first node; documents keep the
    order given. Document order is the nodes' `start_char_idx` when every node of the document has one, else their
    PREVIOUS / NEXT relationships (a node after the node its PREVIOUS names, chains kept in the order their first
    nodes came), else the order given."""
    groups: dict[str, list[Any]] = {}
    for item in nodes:
        node = getattr(item, "node", item)
        groups.setdefault(node.ref_doc_id or node.node_id, []).append(item)
    return [item for group in groups.values() for item in _in_document_order(group)]


def _in_document_order(group: list[Any]) -> list[Any]:
    """One document's nodes in document order (see `document_order`)."""
    nodes = [getattr(item, "node", item) for item in group]
    if len(group) < 2:
        return group
    if all(node.start_char_idx is not None for node in nodes):
        return [item for _, item in sorted(zip(nodes, group), key=lambda pair: pair[0].start_char_idx)]
    by_id = {node.node_id: item for node, item in zip(nodes, group)}
    has_previous = {node.node_id for node in nodes if node.prev_node is not None and node.prev_node.node_id in by_id}
    ordered: list[Any] = []
    placed: set[str] = set()
    for node in nodes:  # each chain from its head, following NEXT (or the PREVIOUS of a later node)
        if node.node_id in has_previous or node.node_id in placed:
            continue
        current: BaseNode | None = node
        while current is not None and current.node_id not in placed:
            placed.add(current.node_id)
            ordered.append(by_id[current.node_id])
            following = [other for other in nodes if other.prev_node is not None
                         and other.prev_node.node_id == current.node_id and other.node_id not in placed]
            if not following and current.next_node is not None and current.next_node.node_id in by_id:
                following = [getattr(by_id[current.next_node.node_id], "node", by_id[current.next_node.node_id])]
            current = following[0] if following else None
    ordered.extend(item for node, item in zip(nodes, group) if node.node_id not in placed)  # a cycle: as given
    return ordered


def node_follows(nodes: Sequence[BaseNode]) -> list[bool]:
    """Per node (in prompt order), whether it is the next chunk of the node before it in its document: LlamaIndex's
    PREVIOUS relationship of node i (set by its node parsers) names node i-1 (`pipeline.follows_of`)."""
    return follows_of([node.node_id for node in nodes],
                      [node.prev_node.node_id if node.prev_node is not None else None for node in nodes])


def prompt_text(head: Sequence[str], chunks: Sequence[str], tail: Sequence[str]) -> str:
    """The prompt as the model reads it: every segment's text in order."""
    return "".join([*head, *chunks, *tail])
