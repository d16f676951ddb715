"""A RAG request as segments: prefix, one segment per chunk, question. Each segment is tokenized on its own.

The modes a request is assembled under are `modes.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field



@dataclass(slots=True)
class Request:
    """prefix_ids: instruction at position 0 (may be empty); chunk_ids: one token list per retrieved chunk;
    question_ids: the final segment (non-empty: its last token's logits start generation); chunk_ranks: how
    much each chunk matters, 0 = most (e.g. its retrieval rank), read by recompute policies that recompute some
    chunks whole (`recompute_policy.py`); empty: prompt order. chunk_follows: whether chunk i is the next chunk of
    chunk i-1's document (read by chained recompute policies, `anchoring.chained_anchor`; empty: none is). answer_lead: whitespace taken off the end of the
    prompt's text (`prompt.split_trailing_space`): the model writes it as its answer's first character, and the
    generation's text leaves it out there."""

    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    question_ids: list[int]
    chunk_labels: list[str] = field(default_factory=list)
    chunk_ranks: list[int] = field(default_factory=list)
    answer_lead: str = ""
    chunk_follows: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.question_ids:
            raise ValueError("the question segment must not be empty")
        if any(len(chunk) == 0 for chunk in self.chunk_ids):
            raise ValueError("chunks must not be empty")
        if self.chunk_ranks and len(self.chunk_ranks) != len(self.chunk_ids):
            raise ValueError(f"{len(self.chunk_ranks)} chunk ranks for {len(self.chunk_ids)} chunks")
        if self.chunk_follows and len(self.chunk_follows) != len(self.chunk_ids):
            raise ValueError(f"{len(self.chunk_follows)} chunk_follows flags for {len(self.chunk_ids)} chunks")
        if self.chunk_follows and self.chunk_follows[0]:
            raise ValueError("the first chunk follows no chunk (chunk_follows[0] must be False)")

    @property
    def segments(self) -> list[list[int]]:
        """The cacheable segments in order: prefix (when present), then the chunks."""
        return ([self.prefix_ids] if self.prefix_ids else []) + list(self.chunk_ids)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix_ids) + sum(map(len, self.chunk_ids)) + len(self.question_ids)

    def all_ids(self) -> list[int]:
        return [token for segment in self.segments for token in segment] + list(self.question_ids)
