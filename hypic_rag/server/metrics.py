"""Prometheus metrics of one service instance (own registry, so several apps can live in one process).

Exported (text format at `GET /metrics`):
    hypic_requests_total{route,method,status}          HTTP requests answered
    hypic_request_duration_seconds{route}               time to the last byte of the response
    hypic_time_to_first_token_seconds{route}            from receipt to the first generated token
    hypic_queue_depth / hypic_queue_capacity            requests waiting or running in the model worker
    hypic_queue_rejections_total                        requests refused with 429
    hypic_segment_cache_hits_total / _misses_total      segment lookups by this server's requests
    hypic_tokens_total{kind}                            prompt, cached (reused from before the request),
                                                        encoded (entries encoded during it), recomputed and
                                                        completion tokens
    hypic_segment_cache_bytes / _entries                what the persistent cache holds (store-wide)
    hypic_segment_cache_hot_bytes                       this process's in-memory tier
    hypic_segment_cache_remote_<counter>_total          with a remote tier: this process's remote lookups
                                                        (hits, misses, errors, corrupt, skipped), uploads
                                                        (puts, puts_skipped, puts_dropped) and bytes
                                                        (bytes_read, bytes_written)
    hypic_segment_cache_remote_up / _queue_bytes        remote reachable (1) or cooling down after a failure
                                                        (0); bytes waiting for upload
    hypic_jobs{status}                                  document jobs by status
    hypic_running_sequences / hypic_waiting_requests    sequences generating in the batch / requests waiting
                                                        (queued, or waiting for admission to the batch)
    hypic_batch_size                                    sequences per batched step (histogram)
    hypic_step_tokens                                   tokens per batched step (histogram)
    hypic_scheduler_steps_total                         batched steps run
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
STEP_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048, 4096, 16384)


class _SnapshotCollector:
    """Gauges read at scrape time from callables (cache snapshot, job counts)."""

    def __init__(self, cache_snapshot: Callable[[], dict[str, Any]], job_counts: Callable[[], dict[str, int]]) -> None:
        self._cache_snapshot = cache_snapshot
        self._job_counts = job_counts

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        snapshot = self._cache_snapshot() or {}
        for name, key, documentation in (
            ("hypic_segment_cache_bytes", "value_bytes", "Bytes of encoded entries in the persistent segment cache."),
            ("hypic_segment_cache_entries", "entries", "Entries in the persistent segment cache."),
            ("hypic_segment_cache_hot_bytes", "hot_bytes", "Bytes held by this process's in-memory cache tier."),
        ):
            family = GaugeMetricFamily(name, documentation)
            family.add_metric([], float(snapshot.get(key, 0)))
            yield family
        if "remote_url" in snapshot:
            yield from _remote_families(snapshot)
        jobs = GaugeMetricFamily("hypic_jobs", "Document jobs by status.", labels=["status"])
        for status, count in self._job_counts().items():
            jobs.add_metric([status], float(count))
        yield jobs


REMOTE_COUNTERS = {
    "hits": "Segments served from the remote cache tier.",
    "misses": "Segment lookups the remote tier did not serve (absent, failed, skipped or bad).",
    "errors": "Failed calls to the remote tier.",
    "corrupt": "Remote objects that failed their checksum (deleted and recomputed).",
    "skipped": "Remote calls not made while the tier cooled down after a failure.",
    "puts": "Entries uploaded to the remote tier.",
    "puts_skipped": "Uploads skipped: the same value was already there.",
    "puts_dropped": "Uploads dropped: queue full, remote failing, or shutting down.",
    "bytes_read": "Bytes fetched from the remote tier.",
    "bytes_written": "Bytes uploaded to the remote tier.",
}


def _remote_families(snapshot: dict[str, Any]):  # noqa: ANN202 - metric families
    """The remote tier's counters and gauges from a cache snapshot that has them."""
    for name, documentation in REMOTE_COUNTERS.items():
        family = CounterMetricFamily(f"hypic_segment_cache_remote_{name}", documentation)
        family.add_metric([], float(snapshot.get(f"remote_{name}", 0)))
        yield family
    up = GaugeMetricFamily("hypic_segment_cache_remote_up", "1 when the remote tier answers, 0 while it fails.")
    up.add_metric([], 1.0 if snapshot.get("remote_available") else 0.0)
    yield up
    queued = GaugeMetricFamily("hypic_segment_cache_remote_queue_bytes", "Bytes waiting for upload to the remote tier.")
    queued.add_metric([], float(snapshot.get("remote_queue_bytes", 0)))
    yield queued


class ServiceMetrics:
    """The metrics of one app. `queue_depth`, `cache_snapshot` and `job_counts` are read at scrape time."""

    def __init__(
        self, *, queue_depth: Callable[[], int], queue_capacity: int, cache_snapshot: Callable[[], dict[str, Any]],
        job_counts: Callable[[], dict[str, int]], running: Callable[[], int] = lambda: 0,
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "hypic_requests", "HTTP requests answered.", ["route", "method", "status"], registry=registry
        )
        self.duration = Histogram(
            "hypic_request_duration_seconds", "Request duration to the last byte.", ["route"],
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self.ttft = Histogram(
            "hypic_time_to_first_token_seconds", "From receipt of the request to its first generated token.",
            ["route"], buckets=TTFT_BUCKETS, registry=registry,
        )
        depth = Gauge("hypic_queue_depth", "Requests waiting for or running in the model worker.", registry=registry)
        depth.set_function(lambda: float(queue_depth()))
        capacity = Gauge("hypic_queue_capacity", "Requests that may wait before new ones get 429.", registry=registry)
        capacity.set(queue_capacity)
        self.rejections = Counter(
            "hypic_queue_rejections", "Requests refused with 429 (queue full).", registry=registry
        )
        self.cache_hits = Counter("hypic_segment_cache_hits", "Segments served from the cache.", registry=registry)
        self.cache_misses = Counter("hypic_segment_cache_misses", "Segments encoded on demand.", registry=registry)
        self.tokens = Counter("hypic_tokens", "Tokens by kind.", ["kind"], registry=registry)
        running_gauge = Gauge("hypic_running_sequences", "Sequences generating in the batch (admitted).",
                              registry=registry)
        running_gauge.set_function(lambda: float(running()))
        waiting_gauge = Gauge("hypic_waiting_requests",
                              "Requests waiting: queued, or waiting for admission to the batch.", registry=registry)
        waiting_gauge.set_function(lambda: float(waiting()))
        self.batch_size = Histogram("hypic_batch_size", "Sequences in one batched step (prefills and decodes).",
                                    buckets=BATCH_SIZE_BUCKETS, registry=registry)
        self.step_tokens = Histogram("hypic_step_tokens", "Tokens one batched step ran through the model.",
                                     buckets=STEP_TOKEN_BUCKETS, registry=registry)
        self.steps = Counter("hypic_scheduler_steps", "Batched steps run.", registry=registry)
        registry.register(_SnapshotCollector(cache_snapshot, job_counts))
        self._lookups = {"cache_hits": 0, "cache_misses": 0}
        self._tokens = {"prompt": 0, "cached": 0, "encoded": 0, "recomputed": 0, "completion": 0}

    def observe_generation(self, route: str, usage: dict[str, int], ttft_seconds: float) -> None:
        """Record one finished generation: its segment lookups, tokens and time to first token."""
        self.ttft.labels(route).observe(ttft_seconds)
        self.cache_hits.inc(usage.get("cache_hits", 0))
        self.cache_misses.inc(usage.get("cache_misses", 0))
        self._lookups["cache_hits"] += usage.get("cache_hits", 0)
        self._lookups["cache_misses"] += usage.get("cache_misses", 0)
        for kind in self._tokens:
            count = usage.get(f"{kind}_tokens", 0)
            self.tokens.labels(kind).inc(count)
            self._tokens[kind] += count

    def observe_step(self, report: Any) -> None:
        """Record one scheduler step (`hypic_rag.runtime.scheduler.StepReport`): its batch size and tokens."""
        self.steps.inc()
        if report.sequences:
            self.batch_size.observe(report.sequences)
            self.step_tokens.observe(report.tokens)

    def server_summary(self) -> dict[str, Any]:
        """This server's lookups and token totals, for `/v1/cache/stats`."""
        lookups = self._lookups["cache_hits"] + self._lookups["cache_misses"]
        return {
            **self._lookups,
            "hit_rate": round(self._lookups["cache_hits"] / lookups, 4) if lookups else 0.0,
            "tokens": dict(self._tokens),
        }

    def render(self) -> bytes:
        return generate_latest(self.registry)
