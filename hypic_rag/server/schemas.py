"""Request and response bodies of the hypic-rag endpoints (`/v1/ask`, documents, jobs, cache, health).

Validation here gives 422 naming the field; checks that need the server's settings (sizes: 413; mode and empty
question: 400) are made by the handlers.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    """Unknown fields are refused (422), so a misspelt option never silently falls back to its default."""

    model_config = ConfigDict(extra="forbid")


class AskRequest(_Strict):
    question: str = Field(description="The question; answered from the top_k retrieved chunks.")
    top_k: int = Field(4, ge=1, le=256, description="Chunks retrieved (each one a cached segment).")
    max_new_tokens: int = Field(48, ge=1, description="Most tokens generated.")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (with temperature > 0).")
    seed: int | None = Field(None, description="Makes sampling reproducible.")
    mode: str = Field(
        "hypic",
        description="Assembly mode: hypic (default), transition_rope, transition, addition, prefix or full.",
    )
    stream: bool = Field(False, description="Answer as server-sent events (text/event-stream).")
    timeout_s: float | None = Field(
        None, gt=0.0, description="Deadline in seconds, queue wait included (at most the server's own)."
    )


class SourceOut(BaseModel):
    document: str = Field(description="Id of the document the chunk comes from.")
    chunk_id: str
    score: float = Field(description="Cosine similarity of the chunk to the question.")
    text: str = Field(description="The chunk's text span.")
    position: int = Field(description="The chunk's order within its document.")
    source: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int = Field(description="Prompt tokens served from cached segment entries.")
    recomputed_tokens: int = Field(description="Prompt tokens run through the model (seams, question, misses).")
    completion_tokens: int
    cache_hits: int = Field(description="Segments found in the cache.")
    cache_misses: int = Field(description="Segments encoded for this request (and stored).")


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
    finish_reason: str
    usage: Usage
    timings: AskTimings


class DocumentIn(_Strict):
    id: str = Field(min_length=1, max_length=512, description="Stable document id; re-adding an id replaces it.")
    text: str = Field(description="The document's text.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="JSON fields kept with every chunk.")


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
    document: str
    deleted: bool
    chunks_removed: int


class CacheStatsOut(BaseModel):
    cache: dict[str, Any] = Field(description="Segment cache counters and sizes (store-wide and this process).")
    index: dict[str, int] = Field(description="Documents, chunks and tokens in the index.")
    server: dict[str, Any] = Field(description="This server's segment lookups and token accounting.")


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
