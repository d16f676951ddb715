"""One retrieval hop: follow the best hit's sentences that point at other documents.

A two-hop question ("Where is the employer of Ada Lind based?") matches the first document (Ada Lind's) but not
the second (her employer's): nothing in the question names the employer. A sentence of the first document does
("She works for Kestrel Works."), and once the question's own words are taken out of it ("She works for Kestrel
Works.") it is a query for the second document. Which sentence: those that introduce a proper name the question
does not contain (a capitalised word after the sentence's first word) come first, since a bridge to another
document is a name; within each group, the sentence whose new words are most similar to the question first.
Each hop place is filled by the best new hit of one such follow-up query.

On the synthetic held-out corpus (500 questions, k = 8, MiniLM), both gold documents of a two-hop question are
retrieved for 36% of them without a hop, 72% with one hop place following the most question-like sentence, and
98% with two hop places and names first (the default); single-hop recall stays 100% (`gold_recall_*` in
`evals/eval_default_model.py`'s report; `tests/retrieval/test_multi_hop.py` checks the rise on real indexes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_WORD_EDGE = "?!.,;:'\"()"


def sentences_of(text: str) -> list[str]:
    """`text` split after '.', '!' or '?' followed by white space; empty pieces dropped."""
    return [piece.strip() for piece in _SENTENCE_END.split(text) if piece.strip()]


def novel_words(sentence: str, question: str) -> str:
    """The words of `sentence` (in order) whose case-folded, punctuation-stripped form is not in `question`."""
    asked = {word.strip(_WORD_EDGE).casefold() for word in question.split()}
    return " ".join(word for word in sentence.split() if word.strip(_WORD_EDGE).casefold() not in asked)


def introduces_name(sentence: str, question: str) -> bool:
    """Whether `sentence` has a capitalised word after its first word that the question does not contain."""
    asked = {word.strip(_WORD_EDGE).casefold() for word in question.split()}
    words = [word.strip(_WORD_EDGE) for word in sentence.split()[1:]]
    return any(word[:1].isupper() and word.casefold() not in asked for word in words)


def hop_candidates(question: str, passage: str) -> list[tuple[str, str]]:
    """(sentence, follow-up query) for each sentence of `passage` that has new words (`novel_words`), each
    follow-up once, in the passage's order: what `rank_hop_candidates` ranks once the follow-ups are embedded."""
    candidates: list[tuple[str, str]] = []
    for sentence in sentences_of(passage):
        follow = novel_words(sentence, question)
        if follow and follow not in (known for _, known in candidates):
            candidates.append((sentence, follow))
    return candidates


def hop_shortlist(question: str, candidates: Sequence[tuple[str, str]], limit: int) -> list[tuple[str, str]]:
    """The candidates `rank_hop_candidates` may choose among its best `limit`: all of them, or only those
    introducing a name when there are at least `limit` of those (the others rank after every one of them). Only
    these need embedding; ranking the shortlist gives the same `limit` follow-ups as ranking every candidate."""
    naming = [candidate for candidate in candidates if introduces_name(candidate[0], question)]
    return naming if len(naming) >= limit else list(candidates)


def rank_hop_candidates(
    question: str, question_vector: np.ndarray, candidates: Sequence[tuple[str, str]], vectors: np.ndarray, limit: int
) -> list[tuple[str, np.ndarray]]:
    """The best `limit` of `candidates` (`hop_candidates`, their follow-ups embedded as `vectors` [n, d],
    normalised), each with its embedding [d]: those introducing a name first, each group ordered by cosine
    similarity to the question (`question_vector` [d])."""
    if limit <= 0 or not candidates:
        return []
    similarity = vectors @ question_vector
    order = sorted(range(len(candidates)),
                   key=lambda i: (not introduces_name(candidates[i][0], question), -float(similarity[i])))
    return [(candidates[i][1], vectors[i]) for i in order[:limit]]


def hop_queries(
    question: str, question_vector: np.ndarray, passage: str, embed: Callable[[Sequence[str]], np.ndarray], limit: int,
) -> list[tuple[str, np.ndarray]]:
    """Up to `limit` follow-up queries of `question` (embedded as `question_vector` [d]) after retrieving `passage`,
    each with its embedding [d] (ready to search): the new words (`novel_words`) of the passage's sentences, those
    introducing a name first, each group ordered by cosine similarity to the question (`embed` returns normalised
    vectors [n, d]). Empty when nothing is new. (`CorpusIndex.search_many` runs the two halves itself, embedding
    the candidates of many questions in one call.)"""
    if limit <= 0:
        return []
    candidates = hop_shortlist(question, hop_candidates(question, passage), limit)
    if not candidates:
        return []
    return rank_hop_candidates(question, question_vector, candidates, embed([follow for _, follow in candidates]),
                               limit)


def merge_hop_hits(direct: Sequence, hops: Sequence[Sequence], k: int, hop_slots: int, key: Callable) -> list:
    """k hits: the first k - hop_slots direct hits, then one new hit from each hop list in turn (its best hit not
    already taken; a second round if places remain), then the remaining direct hits in order (so a hop that finds
    nothing new costs nothing)."""
    direct_count = max(0, k - hop_slots)
    kept = list(direct[:direct_count])
    taken = {key(hit) for hit in kept}
    added = 0
    positions = [0] * len(hops)
    while added < hop_slots and any(position < len(hop) for position, hop in zip(positions, hops)):
        for number, hop in enumerate(hops):
            while positions[number] < len(hop) and key(hop[positions[number]]) in taken:
                positions[number] += 1
            if added < hop_slots and positions[number] < len(hop):
                hit = hop[positions[number]]
                kept.append(hit)
                taken.add(key(hit))
                added += 1
    for hit in direct[direct_count:]:
        if len(kept) >= k:
            break
        if key(hit) not in taken:
            kept.append(hit)
            taken.add(key(hit))
    return kept
