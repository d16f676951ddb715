"""Request streams of the four workloads, as token ids over a shared pool of chunks (so chunks recur).

1. rag_qa: k chunks per request drawn by Zipf popularity from a pool, random order, warm cache.
2. long_context: many long chunks plus a question.
3. agentic: a context that grows turn by turn with tool outputs, documents re-retrieved in new orders.
4. cold: every chunk new (a cache miss in every mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hypic_rag.runtime.request import Request


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    warmup: list[Request]
    pool: list[list[int]]
    cold: bool = False
    load: list[Request] = field(default_factory=list)  # fresh draws for the closed-loop throughput phase


class TokenSource:
    """Deterministic random token ids from a seed."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.random = np.random.default_rng(seed)

    def ids(self, length: int) -> list[int]:
        return self.random.integers(3, self.vocab_size, size=length).tolist()


def zipf_weights(count: int, exponent: float = 1.1) -> np.ndarray:
    weights = 1.0 / np.arange(1, count + 1) ** exponent
    return weights / weights.sum()


def rag_qa(
    tokens: TokenSource, *, top_k: int, pool_size: int, chunk_tokens: int, requests: int, warmup: int,
    prefix_tokens: int = 32, question_tokens: int = 24,
) -> Workload:
    prefix = tokens.ids(prefix_tokens)
    pool = [tokens.ids(chunk_tokens) for _ in range(pool_size)]
    weights = zipf_weights(pool_size)

    def draw() -> Request:
        picked = tokens.random.choice(pool_size, size=min(top_k, pool_size), replace=False, p=weights)
        tokens.random.shuffle(picked)
        return Request(prefix, [pool[i] for i in picked], tokens.ids(question_tokens))

    measured = [draw() for _ in range(requests)]
    warm = [draw() for _ in range(warmup)]
    return Workload(f"rag_qa_k{top_k}", measured, warm, pool, load=[draw() for _ in range(requests)])


def long_context(tokens: TokenSource, *, chunks: int, chunk_tokens: int, requests: int, question_tokens: int = 32) -> Workload:
    prefix = tokens.ids(32)
    pool = [tokens.ids(chunk_tokens) for _ in range(chunks)]
    made = []
    for _ in range(requests):
        order = tokens.random.permutation(chunks)
        made.append(Request(prefix, [pool[i] for i in order], tokens.ids(question_tokens)))
    return Workload(f"long_context_{chunks}x{chunk_tokens}", made, [], pool)


def agentic(
    tokens: TokenSource, *, turns: int, documents: int, document_tokens: int, tool_tokens: int, per_turn: int,
) -> Workload:
    """Turn t: prefix, the documents retrieved this turn (a new subset and order), the tool outputs so far, the
    user's next message. Documents recur across turns in different orders; tool outputs accumulate."""
    prefix = tokens.ids(48)
    pool = [tokens.ids(document_tokens) for _ in range(documents)]
    tool_outputs: list[list[int]] = []
    made = []
    for _ in range(turns):
        picked = tokens.random.choice(documents, size=min(per_turn, documents), replace=False)
        tool_outputs.append(tokens.ids(tool_tokens))
        made.append(Request(prefix, [pool[i] for i in picked] + list(tool_outputs), tokens.ids(16)))
    return Workload(f"agentic_{turns}turns", made, [], pool + tool_outputs)


def cold(tokens: TokenSource, *, top_k: int, chunk_tokens: int, requests: int) -> Workload:
    prefix = tokens.ids(32)
    made = [Request(prefix, [tokens.ids(chunk_tokens) for _ in range(top_k)], tokens.ids(24)) for _ in range(requests)]
    return Workload(f"cold_k{top_k}", made, [], [], cold=True)
