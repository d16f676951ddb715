"""Documents and jobs: `GET /v1/documents` (the list), `POST /v1/documents` (background job), `GET /v1/jobs/{id}`,
`DELETE /v1/documents/{id}`."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from hypic_rag.retrieval.parsers import binary_reason, looks_binary
from hypic_rag.server.backend import NewDocument
from hypic_rag.server.errors import BadRequestError, ConflictError, NotFoundError, PayloadTooLargeError
from hypic_rag.server.schemas import (
    AddDocumentsRequest,
    DeletedDocument,
    DocumentListOut,
    DocumentOut,
    JobAccepted,
    JobOut,
)
from hypic_rag.server.service import Service, ServiceDep
from hypic_rag.server.task_context import TaskContext

router = APIRouter(tags=["documents"])


def checked_documents(body: AddDocumentsRequest, service: Service) -> list[NewDocument]:
    """413 for too many or too long documents, 400 for empty texts, binary data sent as text, or repeated ids."""
    config = service.config
    if len(body.documents) > config.max_documents:
        raise PayloadTooLargeError(
            f"{len(body.documents)} documents in one request; this server accepts at most {config.max_documents}",
            param="documents",
        )
    seen: set[str] = set()
    documents = []
    for number, item in enumerate(body.documents):
        field = f"documents[{number}]"
        if len(item.text) > config.max_document_chars:
            raise PayloadTooLargeError(
                f"{field}.text has {len(item.text)} characters; this server accepts at most "
                f"{config.max_document_chars}",
                param=f"{field}.text",
            )
        if not item.text.strip():
            raise BadRequestError(f"{field}.text is empty", param=f"{field}.text")
        if looks_binary(item.text):  # as the loader skips a binary file: it would be thousands of junk chunks
            raise BadRequestError(f"{field}.text is {binary_reason(item.text)}", param=f"{field}.text")
        if not item.id.strip():
            raise BadRequestError(f"{field}.id is blank", param=f"{field}.id")
        if item.id in seen:
            raise BadRequestError(f"{field}.id {item.id!r} appears twice in this request", param=f"{field}.id")
        seen.add(item.id)
        documents.append(NewDocument(item.id, item.text, dict(item.metadata)))
    return documents


async def check_document_tokens(documents: list[NewDocument], service: Service) -> None:
    """413 for a document over the server's `max_document_tokens`.

    A text of fewer UTF-8 bytes than the limit cannot exceed it (a byte-level tokenizer makes at most one token
    per byte; one more for a leading word marker), so only longer texts are counted, in a thread (the counter has
    its own tokenizer), never on the model worker.
    """
    limit = service.config.max_document_tokens
    counter = service.backend.token_counter
    for number, document in enumerate(documents):
        if len(document.text.encode("utf-8", "surrogatepass")) + 1 <= limit:
            continue
        field = f"documents[{number}].text"
        try:
            tokens = await asyncio.to_thread(counter.count, document.text)
        except (TypeError, ValueError) as error:
            raise BadRequestError(f"{field} cannot be tokenized: {error}", param=field) from None
        if tokens > limit:
            raise PayloadTooLargeError(
                f"{field} has {tokens} tokens; this server accepts at most {limit} per document "
                "(split it, or raise --max-document-tokens)",
                param=field,
            )


MAX_LISTED_DOCUMENTS = 1000
"""The most documents one `GET /v1/documents` lists (page on with `offset`)."""


@router.get("/v1/documents", response_model=DocumentListOut, summary="The index's documents, by id, a page at a time")
async def list_documents(
    service: ServiceDep,
    offset: int = Query(0, ge=0, le=2**62, description="Documents to skip (by id)."),
    limit: int = Query(100, ge=1, le=MAX_LISTED_DOCUMENTS, description="The most documents listed."),
) -> DocumentListOut:
    """The documents' ids, sources, chunks and tokens, ordered by id; `total` counts them all."""

    def run(backend: Any, context: TaskContext) -> tuple[list[tuple[str, str, int, int]], int]:
        docstore = backend.pipeline.index.docstore
        return docstore.document_list(offset, limit), docstore.counts().documents

    rows, total = await service.control(run)
    return DocumentListOut(
        documents=[DocumentOut(doc_id=doc_id, source=source, chunks=chunks, tokens=tokens)
                   for doc_id, source, chunks, tokens in rows],
        total=total, offset=offset, read_only=service.config.read_only,
    )


@router.post(
    "/v1/documents",
    status_code=202,
    response_model=JobAccepted,
    responses={409: {"description": "The index is read-only."},
               413: {"description": "Too many documents, or one too long (characters or tokens)."},
               429: {"description": "Too many document jobs pending."}},
    summary="Add or replace documents (indexed and encoded in the background)",
)
async def add_documents(body: AddDocumentsRequest, request: Request, service: ServiceDep) -> JSONResponse:
    """Chunk, embed and index the documents, then encode their chunks into the segment cache, as a background
    job. A document is searchable once `progress.documents_indexed` counts it; the job succeeds when every chunk
    is cached. Re-adding an id replaces that document."""
    if service.config.read_only:
        raise ConflictError("the server opened its index read-only (--read-only); documents cannot be added")
    documents = checked_documents(body, service)
    await check_document_tokens(documents, service)
    job = service.jobs.create(
        "add_documents", progress={"documents_total": len(documents), "documents_indexed": 0}
    )
    jobs = service.jobs
    try:
        service.worker.submit_job(job, lambda backend: backend.add_documents(documents, job, jobs))
    except Exception as error:
        jobs.finish(job, "failed", error=str(error))
        raise
    status_url = str(request.url_for("get_job", job_id=job.job_id).path)
    accepted = JobAccepted(job_id=job.job_id, status=job.status, documents=len(documents), status_url=status_url)
    return JSONResponse(accepted.model_dump(), status_code=202, headers={"Location": status_url})


@router.get(
    "/v1/jobs/{job_id}",
    response_model=JobOut,
    name="get_job",
    responses={404: {"description": "No such job."}},
    summary="A background job's status and progress",
)
async def get_job(job_id: str, service: ServiceDep) -> Any:
    snapshot = service.jobs.snapshot(job_id)
    if snapshot is None:
        raise NotFoundError(f"no job with id {job_id!r} (finished jobs are kept for a while only)", param="job_id")
    return snapshot


@router.delete("/v1/documents/{doc_id:path}", response_model=DeletedDocument,
               responses={404: {"description": "No such document."}, 409: {"description": "The index is read-only."}},
               summary="Remove a document and its chunks from the index")
async def delete_document(doc_id: str, service: ServiceDep) -> DeletedDocument:
    if service.config.read_only:
        raise ConflictError("the server opened its index read-only (--read-only); documents cannot be deleted")

    def run(backend: Any, context: TaskContext) -> int:
        return backend.delete_document(doc_id)

    removed = await service.control(run)
    return DeletedDocument(doc_id=doc_id, deleted=True, chunks_removed=removed)
