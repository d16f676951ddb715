"""Choosing a cache format by measurement: the smallest format whose entries keep a model's answers.

For each calibration request the reference is `hypic`'s next-token distribution with float32 entries; each
candidate format (`hypic_rag.entry.compression.CACHE_FORMATS`) assembles the same request from the same entries
stored in that format (`CompressedSource`: compressed once, decoded by the engine as a cache hit would be), and is
scored by the mean and 99th percentile over the requests of KL(float32 entries || format entries), and by the bytes
its entries take. The choice is the format of fewest bytes whose mean KL is at most the target; float32 (KL 0)
when none is. `hypic-rag calibrate` runs it after choosing the recompute policy and records the choice in the index
manifest (`hypic_rag.calibration.index.calibrate_index_format`); the index keeps its format until it is rebuilt in the
chosen one (`hypic-rag precompute --cache-format`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hypic_rag.cache.compressed_source import CompressedSource
from hypic_rag.entry.schema import Entry, entry_tensor_bytes
from hypic_rag.entry.compression import CACHE_FORMATS, DEFAULT_CACHE_FORMAT, CacheFormat, cache_format
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.recompute_policy import RecomputePolicy

logger = logging.getLogger(__name__)

DEFAULT_FORMAT_KL_TARGET = 1e-3
"""Largest mean KL(float32 entries || format entries) of the next-token distribution a chosen format may cost."""


def format_candidates() -> tuple[str, ...]:
    """What `calibrate` compares by default: every registered format (`CACHE_FORMATS`) but float32 (the fallback,
    KL 0)."""
    return tuple(name for name in CACHE_FORMATS if name != DEFAULT_CACHE_FORMAT)


@dataclass(frozen=True, slots=True)
class FormatScore:
    """One format over the calibration requests: KL(float32 entries || this format's) of the next-token
    distribution (mean, 99th percentile, largest), share of requests whose most likely next token is the float32
    run's, and the bytes of the requests' distinct entries against float32's (`bytes_ratio`)."""

    cache_format: str
    mean_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float
    bytes_ratio: float
    requests: int

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FormatScore:
        return cls(str(data["cache_format"]), float(data["mean_kl"]), float(data["p99_kl"]), float(data["max_kl"]),
                   float(data["top1_agreement"]), float(data["bytes_ratio"]), int(data["requests"]))


@dataclass(frozen=True, slots=True)
class FormatChoice:
    """The chosen format, the KL target, whether a compressed format met it, every candidate's scores (smallest
    first)."""

    chosen: str
    kl_target: float
    met: bool
    candidates: tuple[FormatScore, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not (isinstance(self.kl_target, (int, float)) and math.isfinite(self.kl_target) and self.kl_target >= 0):
            raise ValueError(f"the format KL target must be a number >= 0, got {self.kl_target!r}")
        cache_format(self.chosen)

    @property
    def score(self) -> FormatScore | None:
        return next((candidate for candidate in self.candidates if candidate.cache_format == self.chosen), None)

    def to_dict(self) -> dict[str, Any]:
        return {"cache_format": self.chosen, "kl_target": self.kl_target, "met": self.met,
                "candidates": [candidate.to_dict() for candidate in self.candidates]}


def percentile(values: Sequence[float], share: float) -> float:
    """The `share` quantile of `values` (linear interpolation, as numpy's default)."""
    return float(torch.quantile(torch.tensor(list(values), dtype=torch.float64), share))


def score_formats(
    engine: Engine, requests: Sequence[Any], formats: Sequence[str | CacheFormat], *,
    policy: RecomputePolicy | str | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> list[FormatScore]:
    """Every format's scores over `requests` under `hypic` with `policy` (None: the engine's). `engine` reads
    float32 entries (its segment source holds them, or encodes them); each format's engine reads the same entries
    through a `CompressedSource`. One `hypic` prefill per request for the reference and one per format."""
    if not requests:
        raise ValueError("format calibration needs at least one request")
    chosen = [cache_format(name) for name in formats]
    if not chosen:
        raise ValueError("format calibration needs at least one candidate format")
    sources = [CompressedSource(engine.segment_source, candidate) for candidate in chosen]
    engines = [Engine(engine.model, seam_tokens=engine.seam_tokens, segment_source=source,
                      recompute_policy=engine.recompute_policy) for source in sources]
    kls: list[list[float]] = [[] for _ in chosen]
    agree = [0] * len(chosen)
    for done, request in enumerate(requests, start=1):
        reference = engine.prefill(request, "hypic", policy=policy).logits
        best = int(reference.argmax())
        for number, format_engine in enumerate(engines):
            logits = format_engine.prefill(request, "hypic", policy=policy).logits
            kls[number].append(kl_divergence(reference, logits))
            agree[number] += int(logits.argmax()) == best
        if on_progress is not None:
            on_progress(done, len(requests))
    count = len(requests)
    scores = []
    for number, (candidate, source) in enumerate(zip(chosen, sources)):
        float32_bytes = sum(source.float32_bytes.values())
        ratio = sum(source.stored_bytes.values()) / float32_bytes if float32_bytes else 1.0
        scores.append(FormatScore(candidate.name, sum(kls[number]) / count, percentile(kls[number], 0.99),
                                  max(kls[number]), agree[number] / count, ratio, count))
        source.close()
    return scores


def choose_format(scores: Sequence[FormatScore], kl_target: float) -> FormatChoice:
    """The format of fewest bytes (then lower KL) whose mean KL is at most `kl_target`; float32 (not compressed, KL
    0) when none is, `met` False."""
    ordered = tuple(sorted(scores, key=lambda score: (score.bytes_ratio, score.mean_kl)))
    meeting = [score for score in ordered if score.mean_kl <= kl_target]
    if meeting:
        return FormatChoice(meeting[0].cache_format, kl_target, True, ordered)
    return FormatChoice(DEFAULT_CACHE_FORMAT, kl_target, False, ordered)


def calibrate_format(
    engine: Engine, requests: Sequence[Any], formats: Sequence[str | CacheFormat] | None = None,
    kl_target: float = DEFAULT_FORMAT_KL_TARGET, *, policy: RecomputePolicy | str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> FormatChoice:
    """Score `formats` (None: `format_candidates()`) on `requests` (`score_formats`) and choose for `kl_target`
    (`choose_format`)."""
    FormatChoice(DEFAULT_CACHE_FORMAT, kl_target, True)  # checks the target before any work
    if formats is None:
        formats = format_candidates()
    result = choose_format(score_formats(engine, requests, formats, policy=policy, on_progress=on_progress), kl_target)
    score = result.score
    logger.info("cache format calibration: %s (mean KL %.3g, %.1f%% of float32's bytes; target %.3g%s)", result.chosen,
                score.mean_kl if score else 0.0, 100 * (score.bytes_ratio if score else 1.0), kl_target,
                "" if result.met else ", no compressed format met it")
    return result
