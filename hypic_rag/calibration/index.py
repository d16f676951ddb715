"""Calibrating an index: its recompute policy and its cache format; the requests, the choices, the records in its
manifest.

`hypic-rag calibrate` (and this module's `calibrate_index`) builds calibration requests exactly as `ask` builds
its own (the index's retriever, the pipeline's ranking of chunks), scores the candidate policies on them against
`full` (`hypic_rag.calibration.policy`), and records the cheapest one meeting the KL target in the manifest,
where `ask` and `serve` find it. The questions come from a file (one per line, or JSON lines with a "question"
field: questions like the ones the index will be asked are best), or else are probes made from the index itself:
the first sentence of chunks spread evenly over the corpus. A probe needs no answer: the score compares each
policy's next-token distribution with `full`'s on the same request, whatever the question.

The cache format (`calibrate_index_format`, `hypic_rag.calibration.cache_format`) is chosen on the same requests: the
smallest format whose entries keep mean KL(float32 entries || format entries) under `hypic` at most a target.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.calibration.cache_format import FormatChoice, calibrate_format
from hypic_rag.utils.limits import MAX_QUESTION_CHARS, question_problem
from hypic_rag.pipeline.answering import chunk_follows, prompt_order
from hypic_rag.retrieval.multi_hop import sentences_of
from hypic_rag.calibration.policy import Calibration, calibrate
from hypic_rag.runtime.recompute_policy import RecomputePolicy
from hypic_rag.runtime.request import Request

PROBE_CHARACTERS = 200
"""Longest probe question (a chunk's first sentence, cut at a word)."""


class CalibrationError(HypicError, ValueError):
    """Calibration cannot run as asked (no questions, unreadable question file): exit code 2."""

    exit_code = EXIT_BAD_INPUT


MAX_LINE_BYTES = 8 * MAX_QUESTION_CHARS
"""The longest line of a questions file: a question of `MAX_QUESTION_CHARS` characters, JSON-escaped, fits."""


def read_questions(path: str | Path, limit: int | None = None) -> list[str]:
    """Questions of a file: one per line, or JSON lines with a "question" field (blank lines skipped); the first
    `limit` when given (the rest of the file is not read).

    Every line is checked before any question is used, as `ask` checks its question: at most `MAX_LINE_BYTES`
    bytes (read no further: a line of gigabytes costs nothing), UTF-8, a question of at most `MAX_QUESTION_CHARS`
    characters without a lone surrogate (JSON's `"\\ud800"`); a `CalibrationError` naming the file, the line and
    the limit otherwise."""
    path = Path(path).expanduser()
    questions: list[str] = []
    try:
        with path.open("rb") as handle:
            for number in itertools.count(1):
                if limit is not None and len(questions) >= limit:
                    break
                raw = handle.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                question = _question_of_line(raw, f"{path}:{number}")
                if question is not None:
                    questions.append(question)
    except OSError as error:
        raise CalibrationError(f"cannot read questions from {str(path)!r}: {error.strerror or error}") from None
    if not questions:
        raise CalibrationError(f"{str(path)!r} holds no questions")
    return questions


def _question_of_line(raw: bytes, where: str) -> str | None:
    """The question of one line of a questions file (None for a blank line); `CalibrationError` naming `where`."""
    if len(raw) > MAX_LINE_BYTES:
        raise CalibrationError(f"{where}: the line is longer than {MAX_LINE_BYTES} bytes (a question has at most "
                               f"{MAX_QUESTION_CHARS} characters)")
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as error:
        raise CalibrationError(f"{where}: not UTF-8 text (byte {error.start})") from None
    if not line:
        return None
    if line.startswith("{"):
        try:
            value = json.loads(line).get("question")
        except (ValueError, AttributeError):
            value = None
        if not isinstance(value, str) or not value.strip():
            raise CalibrationError(f"{where}: a JSON line needs a non-empty \"question\" string")
        line = value.strip()
    problem = question_problem(line)
    if problem is not None:
        raise CalibrationError(f"{where}: the question {problem}")
    return line


def probe_questions(index: Any, count: int) -> list[str]:
    """Up to `count` distinct probes: the first sentence of chunks spread evenly over the index (its docstore
    order), cut at a word to `PROBE_CHARACTERS`."""
    chunks = list(index.docstore.iter_chunks())
    if not chunks:
        raise CalibrationError("the index holds no chunks to calibrate on")
    step = max(1, len(chunks) // max(1, count))
    probes: dict[str, None] = {}
    for chunk in chunks[::step]:
        sentences = sentences_of(chunk.text)
        if not sentences:
            continue
        probe = sentences[0]
        if len(probe) > PROBE_CHARACTERS:
            probe = probe[:PROBE_CHARACTERS].rsplit(" ", 1)[0]
        probes.setdefault(probe, None)
        if len(probes) >= count:
            break
    return list(probes)


def calibration_requests(pipeline: Any, questions: Sequence[str], top_k: int) -> list[Request]:
    """The requests `ask` would assemble for `questions` (retrieval with the pipeline's hop, chunks ranked)."""
    requests = []
    for question in questions:
        hits = prompt_order(pipeline.index.search(question, top_k, hop_slots=pipeline.hop_slots))
        requests.append(pipeline.request_for(question, [list(hit.chunk.token_ids) for hit in hits],
                                             [hit.hop_query is not None for hit in hits], follows=chunk_follows(hits)))
    return requests


def calibrate_index(
    pipeline: Any, *, kl_target: float, questions: Sequence[str] | None = None, requests: int = 32, top_k: int = 8,
    candidates: Sequence[RecomputePolicy | str] | None = None, max_recompute: float | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[Calibration, dict[str, Any]]:
    """Calibrate `candidates` (None: the registered policies' own, `recompute_policy.calibration_candidates`) on
    `questions` (None: `requests` probes of the index) at `top_k`, choosing among those recomputing at most
    `max_recompute` times the fixed seam's tokens (None: all); returns the calibration and the record to keep in the
    manifest (the calibration, how many requests, their source, top_k, when)."""
    built, source = _requests_of(pipeline, questions, requests, top_k)
    result = calibrate(pipeline.engine, built, candidates, kl_target, max_recompute=max_recompute,
                       on_progress=on_progress)
    record = {**result.to_dict(), "requests": len(built), "source": source, "top_k": top_k,
              "seam_tokens": pipeline.session.seam_tokens, "calibrated_at": time.time()}
    return result, record


def _requests_of(pipeline: Any, questions: Sequence[str] | None, requests: int, top_k: int) -> tuple[list[Request], str]:
    """The calibration requests (`questions`' first `requests`, else `requests` probes of the index) and their
    source."""
    if requests < 1:
        raise CalibrationError(f"requests must be >= 1, got {requests}")
    source = "questions" if questions is not None else "index probes"
    chosen_questions = list(questions)[:requests] if questions is not None else probe_questions(pipeline.index, requests)
    if not chosen_questions:
        raise CalibrationError("no calibration questions")
    return calibration_requests(pipeline, chosen_questions, top_k), source


def calibrate_index_format(
    pipeline: Any, *, kl_target: float, questions: Sequence[str] | None = None, requests: int = 32, top_k: int = 8,
    formats: Sequence[str] | None = None, policy: RecomputePolicy | str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[FormatChoice, dict[str, Any]]:
    """Choose the index's cache format on `questions` (None: `requests` probes of the index) at `top_k`, under
    `hypic` with `policy` (None: the pipeline's); returns the choice and the record to keep in the manifest (the
    choice, how many requests, their source, top_k, the policy, when). The reference entries are float32: the
    index's cache when it is in float32, else encoded for the calibration in this process."""
    from hypic_rag.runtime.engine import Engine

    built, source = _requests_of(pipeline, questions, requests, top_k)
    engine = pipeline.engine
    if pipeline.index.manifest.cache_format != "float32":  # its entries are compressed: encode float32 ones
        engine = Engine(engine.model, seam_tokens=engine.seam_tokens, recompute_policy=engine.recompute_policy)
    choice = calibrate_format(engine, built, formats, kl_target, policy=policy, on_progress=on_progress)
    spec = getattr(policy, "spec", policy) or pipeline.session.recompute_policy.spec
    record = {**choice.to_dict(), "requests": len(built), "source": source, "top_k": top_k, "policy": spec,
              "index_cache_format": pipeline.index.manifest.cache_format, "calibrated_at": time.time()}
    return choice, record
