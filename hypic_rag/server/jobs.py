"""Background jobs (adding documents): their state and progress, readable from any thread.

The model worker advances a job step by step between requests; handlers read snapshots for `GET /v1/jobs/{id}`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINISHED = frozenset({SUCCEEDED, FAILED, CANCELLED})


@dataclass(slots=True)
class Job:
    """One background job. `progress` counters and `result` fields are set by the worker thread only."""

    job_id: str
    kind: str
    status: str = QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    progress: dict[str, int] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def snapshot(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "kind": self.kind,
            "status": self.status,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "progress": dict(self.progress),
            "result": dict(self.result),
        }


class JobRegistry:
    """Jobs by id; keeps every unfinished job and the `keep_finished` most recent finished ones."""

    def __init__(self, keep_finished: int = 1000) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()
        self._keep_finished = keep_finished

    def create(self, kind: str, progress: dict[str, int] | None = None) -> Job:
        job = Job(job_id=uuid.uuid4().hex, kind=kind, progress=dict(progress or {}))
        with self._lock:
            self._jobs[job.job_id] = job
            self._trim()
        return job

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def snapshot(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return job.snapshot() if job is not None else None

    def update(self, job: Job, **progress: int) -> None:
        with self._lock:
            job.progress.update(progress)

    def start(self, job: Job) -> None:
        with self._lock:
            job.status, job.started_at = RUNNING, time.time()

    def finish(self, job: Job, status: str, *, error: str | None = None, result: dict[str, Any] | None = None) -> None:
        if status not in FINISHED:
            raise ValueError(f"not a final job status: {status!r}")
        with self._lock:
            job.status, job.finished_at, job.error = status, time.time(), error
            if result:
                job.result.update(result)
            self._trim()

    def counts(self) -> dict[str, int]:
        """How many jobs are in each status."""
        with self._lock:
            counts = dict.fromkeys((QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED), 0)
            for job in self._jobs.values():
                counts[job.status] += 1
            return counts

    def _trim(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - self._keep_finished)]:
            del self._jobs[job_id]
