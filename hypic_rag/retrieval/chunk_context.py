"""How an index finds the chunks of a document that do not name their subject: contextual chunk embeddings and
neighbour expansion, recorded in the index manifest (`RetrievalSettings`).

A document longer than a chunk names its subject once, in its first chunk; a later chunk says "she", "the
company", "two years later". A question names the subject, so by similarity it finds the first chunk and misses
the later one, even when the answer is there. Two remedies, both here:

- **Contextual embedding** (`embedding_context`, index time): each chunk is embedded with a short context from its
  document written before its text (`embedding_texts`); the chunk's text, token ids and cache entries stay exactly
  the chunk's, only the vector changes. Kinds: `none` (the chunk's text alone), `title` (the document's title and
  the chunk's section path, where the file format gives them), `document_head` (`title` plus the document's first
  sentence, for every chunk after the first), `previous_tail` (`title` plus the last sentence of the chunk before
  it). A chunk's id covers its context (`contextual_chunk_id`), so a chunk whose context changed is embedded again.
- **Neighbour expansion** (`neighbours`, `neighbour_slots`, query time; as LlamaIndex's
  `PrevNextNodePostprocessor`): the retrieved chunks bring their document's next (`next`), previous (`previous`)
  or both (`both`) chunks into the k places, at most `neighbour_slots` of them (`expand_with_neighbours`).

An index records the settings it was built with (`IndexManifest.retrieval`; an index built before has none:
`LEGACY_RETRIEVAL`, the chunk's text alone and no expansion). A writer asking for another embedding context is
refused (the vectors would mix two kinds); the neighbour expansion may be chosen per query.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI's option parsing reads this module's names; it imports nothing heavy
    from hypic_rag.retrieval.chunking import Chunk
    from hypic_rag.retrieval.loading import Document

EMBEDDING_CONTEXTS = ("none", "title", "document_head", "previous_tail")
"""What a chunk is embedded with (see the module docstring)."""
NEIGHBOUR_KINDS = ("none", "next", "previous", "both")
"""Which chunks of a retrieved chunk's document it brings into the k places."""
CONTEXT_CHARS = 300
"""A chunk's context is cut to this many characters (at a word boundary), so that it never crowds out the chunk's
own text in the embedder's window."""


@dataclass(frozen=True, slots=True)
class RetrievalSettings:
    """How an index embeds its chunks and expands its hits (see the module docstring).

    embedding_context: one of `EMBEDDING_CONTEXTS` (decided when the index is built). neighbours: one of
    `NEIGHBOUR_KINDS`; neighbour_slots: how many of a query's k places neighbours may take (0 with `none`).
    """

    embedding_context: str = "none"
    neighbours: str = "none"
    neighbour_slots: int = 0

    def __post_init__(self) -> None:
        if self.embedding_context not in EMBEDDING_CONTEXTS:
            raise ValueError(f"embedding context must be one of {', '.join(EMBEDDING_CONTEXTS)}, "
                             f"got {self.embedding_context!r}")
        if self.neighbours not in NEIGHBOUR_KINDS:
            raise ValueError(f"neighbours must be one of {', '.join(NEIGHBOUR_KINDS)}, got {self.neighbours!r}")
        if not isinstance(self.neighbour_slots, int) or self.neighbour_slots < 0:
            raise ValueError(f"neighbour slots must be an integer >= 0, got {self.neighbour_slots!r}")
        if (self.neighbours == "none") != (self.neighbour_slots == 0):
            raise ValueError("neighbour expansion needs both a kind other than none and at least one slot "
                             f"(got {self.neighbours_spec!r}); none:0 turns it off")

    @property
    def neighbours_spec(self) -> str:
        """The expansion as `KIND:SLOTS` (`next:2`, `none:0`), the form `--neighbours` takes."""
        return f"{self.neighbours}:{self.neighbour_slots}"

    @property
    def name(self) -> str:
        """One line naming the settings, e.g. `document_head embeddings + next:2 neighbours`."""
        return f"{self.embedding_context} embeddings + {self.neighbours_spec} neighbours"

    def with_neighbours(self, spec: str | None) -> RetrievalSettings:
        """These settings with the expansion `spec` (`KIND:SLOTS`, `KIND` alone means one slot, `none`); None
        keeps them."""
        if spec is None:
            return self
        kind, _, slots = spec.strip().partition(":")
        try:
            count = int(slots) if slots else (0 if kind == "none" else 1)
        except ValueError:
            raise ValueError(f"neighbours must be KIND[:SLOTS] (e.g. next:2, both:2, none), got {spec!r}") from None
        return replace(self, neighbours=kind, neighbour_slots=count)

    def to_dict(self) -> dict[str, Any]:
        return {"embedding_context": self.embedding_context, "neighbours": self.neighbours,
                "neighbour_slots": self.neighbour_slots}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetrievalSettings:
        return cls(str(data["embedding_context"]), str(data["neighbours"]), int(data["neighbour_slots"]))


LEGACY_RETRIEVAL = RetrievalSettings()
"""What an index built before the settings were recorded does: the chunk's text alone, no expansion."""
DEFAULT_RETRIEVAL = RetrievalSettings("document_head", "next", 1)
"""What a new index is built with (docs/retrieval.md, "Documents longer than a chunk", measures the choice)."""


def _clipped(text: str, limit: int = CONTEXT_CHARS) -> str:
    """`text` on one line, cut at the last word boundary within `limit` characters."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit]
    return cut[: cut.rfind(" ")] if " " in cut else cut


def chunk_contexts(document: Document, chunks: Sequence[Chunk], kind: str) -> list[str]:
    """Per chunk of `document` (`chunks` in document order), the context text it is embedded with under `kind`
    ("" when none): see the module docstring. Pure function of the document and its chunks."""
    from hypic_rag.retrieval.multi_hop import sentences_of

    if kind == "none":
        return ["" for _ in chunks]
    title = str(document.metadata.get("title") or "").strip()
    contexts = []
    first_sentence = next(iter(sentences_of(document.text[:4 * CONTEXT_CHARS])), "")
    for number, chunk in enumerate(chunks):
        parts = [title] if title else []
        section = str(chunk.metadata.get("section") or "").strip()
        if section and section != title:
            parts.append(section)
        if kind == "document_head" and number > 0 and first_sentence and first_sentence not in chunk.text:
            parts.append(first_sentence)
        if kind == "previous_tail" and number > 0:
            previous = sentences_of(chunks[number - 1].text)
            if previous:
                parts.append(previous[-1])
        contexts.append(_clipped(" ".join(parts)))
    return contexts


def embedding_text(chunk_text: str, context: str) -> str:
    """What the embedder reads for a chunk: its context on a line before its text (its text alone without one)."""
    return f"{context}\n{chunk_text}" if context else chunk_text


def contextual_chunk_id(chunk: Chunk, context: str) -> str:
    """The chunk's id under a context: its content-derived id when there is none (`chunking.chunk_id_for`), else
    that id and the context digested together, so a chunk whose context changed is a new chunk (embedded again)."""
    if not context:
        return chunk.chunk_id
    return hashlib.sha256(f"{chunk.chunk_id}\0{context}".encode("utf-8")).hexdigest()[:32]


def contextualised(document: Document, chunks: Sequence[Chunk], kind: str) -> tuple[list[Chunk], list[str]]:
    """(chunks with their contextual ids, the texts to embed), in the order given."""
    contexts = chunk_contexts(document, chunks, kind)
    keyed = [chunk if not context else replace(chunk, chunk_id=contextual_chunk_id(chunk, context))
             for chunk, context in zip(chunks, contexts)]
    return keyed, [embedding_text(chunk.text, context) for chunk, context in zip(chunks, contexts)]


def neighbour_positions(position: int, kind: str) -> list[int]:
    """The positions a chunk at `position` brings under `kind`, nearest first (next before previous)."""
    wanted = {"none": [], "next": [position + 1], "previous": [position - 1],
              "both": [position + 1, position - 1]}[kind]
    return [number for number in wanted if number >= 0]


def expand_with_neighbours(hits: Sequence[Any], k: int, settings: RetrievalSettings,
                           fetch: Callable[[list[tuple[str, int]]], dict[tuple[str, int], Any]],
                           make_hit: Callable[[Any, Any], Any]) -> list[Any]:
    """At most k hits (`SearchHit`-like: `.chunk.doc_id`, `.chunk.position`, `.hop_query`), retrieval order kept,
    where the retrieved chunks' neighbours (`settings.neighbours`) take up to `settings.neighbour_slots` places.

    The rule: hits are visited best first; each brings its missing neighbours (nearest first) while slots are
    left, and once the k places are full each neighbour takes the place of the lowest-ranked direct hit below the
    hit that brought it that is neither a source of a neighbour nor the retrieved neighbour of a hit visited
    before it (the retrieval hop's places are kept: they serve other documents). A hit whose place was taken brings nothing; with no such place left the expansion stops. Neighbours go right after the hit that brought them; `prompt_order` then lays a document's
    chunks out in document order. fetch: (doc_id, position) keys -> the stored chunks found (missing: the
    document has no such chunk); make_hit(chunk, source_hit): the hit of a neighbour."""
    hits = list(hits)[:k]
    slots = min(settings.neighbour_slots, max(0, k - 1))
    if settings.neighbours == "none" or slots == 0 or not hits:
        return hits
    wanted = [(hit.chunk.doc_id, number) for hit in hits
              for number in neighbour_positions(hit.chunk.position, settings.neighbours)]
    stored = fetch(list(dict.fromkeys(wanted)))
    present = {(hit.chunk.doc_id, hit.chunk.position) for hit in hits}
    kept = list(hits)
    brought: dict[int, list[Any]] = {}
    at = {(hit.chunk.doc_id, hit.chunk.position): hit for hit in hits}
    sources: set[int] = set()  # ids of the hits no neighbour may displace: sources and neighbours of a kept hit
    added = 0
    for hit in hits:
        if added == slots:
            break
        place = next((number for number, other in enumerate(kept) if other is hit), None)
        if place is None:
            continue
        for number in neighbour_positions(hit.chunk.position, settings.neighbours):
            key = (hit.chunk.doc_id, number)
            if key in present and key in at:  # retrieved already: it stays beside the hit it neighbours
                sources.add(id(at[key]))
            if added == slots or key in present or key not in stored:
                continue
            if len(kept) + added >= k:
                victims = [later for later in range(len(kept) - 1, place, -1)
                           if kept[later].hop_query is None and id(kept[later]) not in sources]
                if not victims:
                    break
                victim = kept.pop(victims[0])
                present.discard((victim.chunk.doc_id, victim.chunk.position))
            present.add(key)
            sources.add(id(hit))
            brought.setdefault(id(hit), []).append(make_hit(stored[key], hit))
            added += 1
    return [item for hit in kept for item in (hit, *brought.get(id(hit), []))]
