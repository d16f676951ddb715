"""Request and response bodies of the hypic-rag endpoints (`/v1/ask`, documents, jobs, cache, health).

Validation here names the field: a field of the wrong type is a 400 (types are strict: `"no"` is not a boolean,
`"3"` not an integer, as OpenAI's and vLLM's servers answer), a value out of its stated range a 422 (text holding a
lone surrogate such as `"\\ud800"` included: no tokenizer takes it); every number has a range (`hypic_rag.utils.limits`).
Checks that need the server's settings (sizes: 413; mode, recompute policy and empty question: 400) are made by the
handlers.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hypic_rag.utils.limits import MAX_NEW_TOKENS, TOP_K
from hypic_rag.runtime.recompute_policy import policy_help
from hypic_rag.runtime.sampling import SEED_MAX
from hypic_rag.utils.text import unencodable_message

SEED_DESCRIPTION = (
    "Makes sampling reproducible: an unsigned 64-bit integer, 0 to 2**64 - 1 (422 outside). Without one, every "
    "request samples afresh."
)


def valid_unicode(value: Any) -> Any:
    """`value` unchanged; ValueError when a string in it (in lists and dicts too, keys included) holds a lone
    surrogate, which UTF-8 cannot encode."""
    if isinstance(value, str):
        message = unencodable_message(value, "text")
        if message is not None:
            raise ValueError(message)
    elif isinstance(value, list):
        for item in value:
            valid_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            valid_unicode(key)
            valid_unicode(item)
    return value


TIMEOUT_MAX_S = 86_400.0
"""The longest deadline a request may name (a day; the server's own deadline caps it further)."""


class _Strict(BaseModel):
    """Unknown fields are refused (422), so a misspelt option never silently falls back to its default; values are
    never coerced from another JSON type (a wrong type is a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class AskRequest(_Strict):
    question: str = Field(description="The question; answered from the top_k retrieved chunks.")
    top_k: int = Field(4, ge=TOP_K.minimum, le=TOP_K.maximum,
                       description="Chunks retrieved (each one a cached segment); the server may allow fewer.")
    max_new_tokens: int = Field(48, ge=MAX_NEW_TOKENS.minimum, le=MAX_NEW_TOKENS.maximum,
                                description="Most tokens generated; the server may allow fewer.")
    temperature: float = Field(
        0.0, ge=0.0, le=5.0, allow_inf_nan=False,
        description="0 is greedy (so is a temperature too small for any but the top token to keep probability).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False,
                         description="Nucleus sampling mass (with temperature > 0).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description=SEED_DESCRIPTION)
    mode: str = Field(
        "hypic",
        description="Assembly mode: hypic (default), transition_rope, transition, addition, prefix or full.",
    )
    recompute_policy: str | None = Field(
        None,
        description=f"What a hypic answer recomputes: {policy_help()}; default: the server's (the index's "
                    "calibrated policy, else seam).",
    )
    stream: bool = Field(False, description="Answer as server-sent events (text/event-stream).")
    timeout_s: float | None = Field(
        None, gt=0.0, le=TIMEOUT_MAX_S, allow_inf_nan=False,
        description="Deadline in seconds, queue wait included (at most the server's own).",
    )

    _valid_unicode = field_validator("question", "mode", "recompute_policy")(valid_unicode)


class SourceOut(BaseModel):
    """One source of the answer, best first, with the fields every surface writes (`hypic_rag.pipeline.vocabulary`)."""

    rank: int = Field(description="1 for the best; sources are listed by score.")
    doc_id: str = Field(description="Id of the document the chunk comes from.")
    chunk_id: str
    score: float = Field(description="Cosine similarity of the chunk to the question.")
    text: str = Field(description="The chunk's text span.")
    source: str = Field("", description="Where the document was read from, relative to the corpus root.")
    position: int = Field(description="The chunk's order within its document.")
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="The document's fields and where the chunk lies in it: page / page_end (PDF), section (HTML, "
                    "DOCX, Markdown), title.",
    )
    hop: bool = Field(False, description="Whether the retrieval hop found the chunk.")
    hop_query: str | None = Field(
        None, description="Set when the retrieval hop found the chunk: the follow-up query that found it."
    )
    hop_score: float | None = Field(None, description="The chunk's similarity to hop_query.")
    neighbour_of: str | None = Field(
        None, description="Set when the index's neighbour expansion brought the chunk (not its own similarity): the "
                          "chunk id of the retrieved chunk of its document that brought it."
    )


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int = Field(
        description="Prompt tokens reused from before this request (cached segment entries that were hits)."
    )
    encoded_tokens: int = Field(
        description="Prompt tokens from segment entries encoded during this request (misses, stored for later ones)."
    )
    recomputed_tokens: int = Field(
        description="Prompt tokens run through the model while assembling (seams, question); "
        "cached + encoded + recomputed = prompt."
    )
    completion_tokens: int
    cache_hits: int = Field(description="Segments found in the cache.")
    cache_misses: int = Field(description="Segments encoded for this request (and stored).")


class PromptPartOut(BaseModel):
    """One part of the prompt an answer was assembled from, in prompt order (`hypic_rag.pipeline.vocabulary.PROMPT_PART_FIELDS`)."""

    part: str = Field(description="prefix, chunk or question.")
    chunk_id: str | None = Field(description="A chunk's id (its source's chunk_id); null for the prefix and the question.")
    tokens: int
    recomputed_tokens: int = Field(description="The part's first tokens, run through the model: a hypic chunk's seam, "
                                               "a chunk recomputed whole, the question, every token in full mode.")
    cached_tokens: int = Field(description="Tokens after those read from entries held before the request.")
    encoded_tokens: int = Field(description="Tokens after those read from entries encoded during the request.")


class AskTimings(BaseModel):
    """Milliseconds. time_to_first_token and total count from the server's receipt of the request."""

    queue_ms: float
    retrieval_ms: float
    cache_load_ms: float
    encode_ms: float
    compose_ms: float
    prefill_ms: float
    time_to_first_token_ms: float
    total_ms: float


class AskResponse(BaseModel):
    answer: str
    sources: list[SourceOut]
    mode: str
    recompute_policy: str = Field("", description="The recompute policy of a hypic answer, its seam explicit "
                                                  "(empty in other modes).")
    finish_reason: str
    usage: Usage
    timings: AskTimings
    note: str | None = Field(None, description="A line to show beside the answer, else null: that the bundled demo "
                                               "model answered over documents outside its synthetic world.")
    prompt_parts: list[PromptPartOut] = Field(
        default_factory=list, description="The prompt part by part (prefix, each chunk, question) with what each "
                                          "recomputed and reused; summed they give the usage's token counts.")


class DocumentIn(_Strict):
    id: str = Field(min_length=1, max_length=512, description="Stable document id; re-adding an id replaces it.")
    text: str = Field(description="The document's text.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="JSON fields kept with every chunk.")

    _valid_unicode = field_validator("id", "text", "metadata")(valid_unicode)


class AddDocumentsRequest(_Strict):
    documents: list[DocumentIn] = Field(min_length=1)


class JobAccepted(BaseModel):
    job_id: str
    status: str
    documents: int
    status_url: str


class JobOut(BaseModel):
    job_id: str
    kind: str
    status: str = Field(description="queued, running, succeeded, failed or cancelled.")
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    progress: dict[str, int] = Field(
        description="documents_total, documents_indexed, chunks_total, chunks_encoded (as far as known)."
    )
    result: dict[str, Any]


class DeletedDocument(BaseModel):
    doc_id: str
    deleted: bool
    chunks_removed: int


class DocumentOut(BaseModel):
    doc_id: str
    source: str = Field(description="Where the document was read from (its id for one added through the API).")
    chunks: int
    tokens: int = Field(description="Tokens of its chunks.")


class DocumentListOut(BaseModel):
    documents: list[DocumentOut] = Field(description="A page of the index's documents, by id.")
    total: int = Field(description="Documents in the index.")
    offset: int
    read_only: bool = Field(description="Whether the server refuses document changes (--read-only).")


class AnsweringOut(BaseModel):
    """How the server answers `/v1/ask`: its model and the recompute policy a `hypic` answer uses by default."""

    model: str
    recompute_policy: str = Field(description="The server's policy, its seam explicit (`seam@8`).")
    policy_from: str = Field(description="Where it comes from: `serve` (--recompute-policy), `calibration` (the "
                                         "index's calibrated policy, `hypic-rag calibrate`) or `default` (the seam).")
    seam_tokens: int = Field(description="The index's seam window.")


class CacheStatsOut(BaseModel):
    cache: dict[str, Any] = Field(description="Segment cache counters and sizes (store-wide and this process).")
    index: dict[str, int] = Field(description="Documents, chunks and tokens in the index.")
    server: dict[str, Any] = Field(description="This server's segment lookups and token accounting.")
    answering: AnsweringOut | None = Field(None, description="The model and default recompute policy (this "
                                                             "process; absent in a front's merged stats).")


class HealthOut(BaseModel):
    status: str
    model: str
    index: str
    read_only: bool
    documents: int
    chunks: int
    queue_depth: int
    queue_capacity: int
    pending_jobs: int
    uptime_s: float
