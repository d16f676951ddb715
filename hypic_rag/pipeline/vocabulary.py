"""The field names every surface gives the same things: `hypic-rag ask --json`, `/v1/ask` (its JSON and its
stream's events), the OpenAI routes' extensions, LlamaIndex's node and response metadata, and the docs
(`docs/CONTRACTS.md` "Field names"). A test compares the surfaces against these tuples
(`tests/server/test_field_names.py`).

A source (one retrieved chunk the answer drew on), best first:
    rank        1 for the best; sources are listed by `score`
    doc_id      the document's id (its path in the corpus, a `.jsonl` record's id, `POST /v1/documents`' `id`)
    chunk_id    the chunk's id; position: its order in the document; text: its text
    score       cosine similarity of the chunk to the question
    source      where the document was read from (relative to the corpus root)
    metadata    the document's fields and where the chunk lies in it (`LOCATION_FIELDS`)
    hop         whether the retrieval hop found it; hop_query: the follow-up query that did (None for a direct
                hit); hop_score: its similarity to that query
    neighbour_of  for a chunk the index's neighbour expansion brought, the chunk id of the retrieved chunk of its
                document that brought it (None for a chunk retrieved by its own similarity)
Usage (token and segment accounting of one answer or completion): `USAGE_FIELDS`, plus `MATCHING_FIELDS` where a
prompt is cut around known chunks (the OpenAI routes, `HypicLLM`). On the OpenAI routes they sit in `usage`
beside OpenAI's own fields (`total_tokens`, `prompt_tokens_details.cached_tokens`, where OpenAI's clients read the
cached count); the `hypic` object holds only the assembly `mode` and the `timings`.
The prompt an answer was assembled from, part by part in prompt order (`PROMPT_PART_FIELDS`, `prompt_parts` in an
answer): the prompt prefix, each retrieved chunk (its `chunk_id` names its source), the question; per part its
`tokens`, of which its first `recomputed_tokens` ran through the model (a seam, a chunk recomputed whole, the
question, every token in `full` mode) and the rest were read from the cache: `cached_tokens` from entries held
before the request, `encoded_tokens` from entries encoded during it. Summed over the parts they are the usage's.
Timings: the stages `TIMING_STAGES`, in seconds under these names in Python objects and `ask --json`, in
milliseconds named `<stage>_ms` in REST responses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOCATION_FIELDS", "MATCHING_FIELDS", "PROMPT_PARTS", "PROMPT_PART_FIELDS", "SOURCE_FIELDS", "TIMING_STAGES",
           "USAGE_FIELDS", "prompt_part_record", "source_record"]

SOURCE_FIELDS = ("rank", "doc_id", "chunk_id", "score", "text", "source", "position", "metadata", "hop",
                 "hop_query", "hop_score", "neighbour_of")
LOCATION_FIELDS = ("page", "page_end", "section", "title")
"""Where a chunk lies, in a source's `metadata` (a LlamaIndex node's metadata holds them directly, with `doc_id`,
`source` and LlamaIndex's own `file_name` / `file_path`)."""
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "encoded_tokens", "recomputed_tokens",
                "cache_hits", "cache_misses")
"""cached + encoded + recomputed = prompt tokens; cache_hits / cache_misses count segments (`Generation.usage`)."""
MATCHING_FIELDS = ("segments", "matched_segments", "matched_tokens", "matched_cached_tokens")
"""segments: the request's segments, the query included; matched_*: those found by matching known chunks in the
prompt's text, their tokens, and those of their tokens reused from entries held before the request."""
PROMPT_PART_FIELDS = ("part", "chunk_id", "tokens", "recomputed_tokens", "cached_tokens", "encoded_tokens")
"""One part of an answer's prompt (`prompt_part_record`); recomputed + cached + encoded = tokens."""
PROMPT_PARTS = ("prefix", "chunk", "question")
"""The kinds of prompt part (`part`), in the order they come in a prompt."""
TIMING_STAGES = ("retrieval", "cache_load", "encode", "compose", "prefill", "time_to_first_token", "total")


def source_record(source: Any, rank: int) -> dict[str, Any]:
    """One source (a `hypic_rag.pipeline.answering.Source`; this leaf module imports nothing) as every surface writes it
    (`SOURCE_FIELDS`, in that order); `rank` 1 for the best."""
    return {
        "rank": rank,
        "doc_id": source.doc_id,
        "chunk_id": source.chunk_id,
        "score": source.score,
        "text": source.text,
        "source": source.source,
        "position": source.position,
        "metadata": dict(source.metadata),
        "hop": source.hop_query is not None,
        "hop_query": source.hop_query,
        "hop_score": source.hop_score,
        "neighbour_of": source.neighbour_of,
    }


def prompt_part_record(part: str, chunk_id: str | None, tokens: int, recomputed_tokens: int,
                       cached_tokens: int) -> dict[str, Any]:
    """One part of an answer's prompt as every surface writes it (`PROMPT_PART_FIELDS`, in that order): `part` one
    of `PROMPT_PARTS`, `chunk_id` the chunk's id (None for the prefix and the question), `tokens` its length, its
    first `recomputed_tokens` run through the model, `cached_tokens` of the rest read from entries held before the
    request; the others (`encoded_tokens`) from entries encoded during it."""
    if part not in PROMPT_PARTS:
        raise ValueError(f"unknown prompt part {part!r}; one of {PROMPT_PARTS}")
    encoded_tokens = tokens - recomputed_tokens - cached_tokens
    if min(recomputed_tokens, cached_tokens, encoded_tokens) < 0:
        raise ValueError(f"a {part} of {tokens} tokens cannot recompute {recomputed_tokens} and reuse {cached_tokens}")
    return {"part": part, "chunk_id": chunk_id, "tokens": tokens, "recomputed_tokens": recomputed_tokens,
            "cached_tokens": cached_tokens, "encoded_tokens": encoded_tokens}
