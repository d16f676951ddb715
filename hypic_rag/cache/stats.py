"""Statistics of a segment cache: persistent store totals plus this process's hot tier and hit split."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from hypic_rag.cache.errors import CorruptEntryError, IncompatibleEntryError
from hypic_rag.cache.store import SegmentStore
from hypic_rag.utils.units import human_bytes


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counts and sizes of a cache.

    Store-wide (persistent, every process): entries, value_bytes (encoded bytes, the budgeted quantity),
    linear_bytes / kv_bytes (tensor bytes of linear state and of attention K/V as stored), hits, misses,
    evictions, corrupt (entries that failed their checksum or decoding), mismatched (an entry under the right
    key whose namespace, token ids or codec version differ), skipped_puts (entries larger than the budget).
    This process only: hot_* (the in-memory tier) and hot_hits / disk_hits (where its hits were served from).
    """

    path: str
    entries: int
    value_bytes: int
    linear_bytes: int
    kv_bytes: int
    hits: int
    misses: int
    evictions: int
    corrupt: int
    mismatched: int
    skipped_puts: int
    budget_bytes: int
    map_bytes: int
    file_bytes: int
    hot_entries: int = 0
    hot_bytes: int = 0
    hot_budget_bytes: int = 0
    hot_evictions: int = 0
    hot_hits: int = 0
    disk_hits: int = 0

    @classmethod
    def from_store(cls, store: SegmentStore, **process_fields: int) -> CacheStats:
        counters = store.counters()
        info = store.info()
        return cls(
            path=str(store.path),
            entries=counters.entries,
            value_bytes=counters.value_bytes,
            linear_bytes=counters.linear_bytes,
            kv_bytes=counters.kv_bytes,
            hits=counters.hits,
            misses=counters.misses,
            evictions=counters.evictions,
            corrupt=counters.corrupt,
            mismatched=counters.mismatched,
            skipped_puts=counters.skipped_puts,
            budget_bytes=int(info["budget_bytes"]),
            map_bytes=int(info["map_bytes"]),
            file_bytes=int(info["file_bytes"]),
            **process_fields,
        )

    def as_dict(self) -> dict[str, Any]:
        """All fields plus per-entry means (bytes_per_entry, linear_/kv_bytes_per_entry) and hit_rate."""
        result = asdict(self)
        entries = max(self.entries, 1)  # an empty store reports 0 per entry
        result["bytes_per_entry"] = self.value_bytes // entries
        result["linear_bytes_per_entry"] = self.linear_bytes // entries
        result["kv_bytes_per_entry"] = self.kv_bytes // entries
        lookups = self.hits + self.misses
        result["hit_rate"] = round(self.hits / lookups, 4) if lookups else 0.0
        return result


def namespace_summary(store: SegmentStore) -> list[dict[str, Any]]:
    """The namespaces a store holds entries of, most entries first: per namespace its cache format, seam width,
    model dtype and entry count. Keys are grouped by their namespace digest and one entry's header is read per
    namespace (without its crc32: this is a listing, `verify` checks entries); an unreadable one shows as
    ``unknown``. Reads every key once (no values besides those headers)."""
    from hypic_rag.cache.codec import read_header  # torch: loaded only when a listing is asked for
    from hypic_rag.cache.keys import NAMESPACE_DIGEST_BYTES

    counts = Counter(key[:NAMESPACE_DIGEST_BYTES] for key in store.keys())
    first_keys: dict[bytes, bytes] = {}
    for key in store.keys():
        first_keys.setdefault(key[:NAMESPACE_DIGEST_BYTES], key)
        if len(first_keys) == len(counts):
            break
    rows = []
    for digest, entries in counts.most_common():
        fields: dict[str, Any] = {"cache_format": "unknown", "seam_tokens": None, "model_dtype": None}
        value = store.get(first_keys[digest], touch=False)
        if value is not None:
            try:
                namespace = json.loads(read_header(value, check_crc=False)[0])
                fields = {name: namespace.get(name, fields[name]) for name in fields}
            except (CorruptEntryError, IncompatibleEntryError, ValueError, AttributeError):
                pass
        rows.append({**fields, "entries": entries})
    return rows


def format_stats(stats: CacheStats, namespaces: list[dict[str, Any]] | None = None) -> str:
    """A short human-readable report, one fact per line (with a line of the formats held, given `namespaces`
    from `namespace_summary`)."""
    data = stats.as_dict()
    lines = [
        f"cache           {stats.path}",
        f"entries         {stats.entries}",
        f"stored bytes    {human_bytes(stats.value_bytes)} of {human_bytes(stats.budget_bytes)} budget"
        f" (file {human_bytes(stats.file_bytes)}, map {human_bytes(stats.map_bytes)})",
        f"per entry       {human_bytes(data['bytes_per_entry'])}: linear state "
        f"{human_bytes(data['linear_bytes_per_entry'])}, K/V {human_bytes(data['kv_bytes_per_entry'])}",
        f"lookups         {stats.hits} hits, {stats.misses} misses (hit rate {data['hit_rate']:.1%})",
        f"evictions       {stats.evictions}",
        f"corrupt         {stats.corrupt} (mismatched {stats.mismatched}, skipped puts {stats.skipped_puts})",
    ]
    if namespaces:
        lines.append("formats         " + ", ".join(
            f"{row['cache_format']} ({row['entries']} entries, seam {row['seam_tokens']})" for row in namespaces))
    return "\n".join(lines)
