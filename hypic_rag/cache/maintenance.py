"""Whole-store checks and clean-up behind `hypic-rag cache verify | gc`.

`verify_store` reads every entry once (outside any long transaction: one short read per entry, so writers are
not held up) and checks that it decodes (crc32, lengths, header, and values that decode finite: no NaN or infinity
in a scale or a stored float) and that its key matches its contents: the key's namespace digest equals the digest
of the namespace text in the header, and its token digest equals the sha256 of the stored token ids.
`collect_garbage` removes what verify flags and evicts down to the budget.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypic_rag.cache.codec import decode_entry
from hypic_rag.cache.errors import CorruptEntryError, IncompatibleEntryError
from hypic_rag.cache.keys import KEY_BYTES, namespace_digest, split_key, token_ids_digest
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.store import SegmentStore
from hypic_rag.entry.schema import TOKEN_IDS


@dataclass(frozen=True, slots=True)
class EntryProblem:
    """One bad entry: its key (hex), kind ('corrupt', 'stale', 'mismatched') and a one-line reason."""

    key_hex: str
    kind: str
    reason: str


@dataclass(slots=True)
class VerifyReport:
    checked: int = 0
    problems: list[EntryProblem] = field(default_factory=list)
    entries_per_namespace: Counter[str] = field(default_factory=Counter)

    @property
    def ok(self) -> int:
        return self.checked - len(self.problems)

    def as_dict(self) -> dict[str, object]:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "problems": [{"key": p.key_hex, "kind": p.kind, "reason": p.reason} for p in self.problems],
            "namespaces": dict(self.entries_per_namespace),
        }


@dataclass(frozen=True, slots=True)
class GcReport:
    removed_bad: int
    evicted: int
    entries_left: int
    bytes_left: int


def check_entry(key: bytes, value: bytearray) -> tuple[EntryProblem | None, str | None]:
    """(problem or None, namespace text when decodable) for one stored entry."""
    key_hex = key.hex()
    if len(key) != KEY_BYTES:
        return EntryProblem(key_hex, "mismatched", f"key of {len(key)} bytes, expected {KEY_BYTES}"), None
    try:
        decoded = decode_entry(value)
    except CorruptEntryError as error:
        return EntryProblem(key_hex, "corrupt", str(error)), None
    except IncompatibleEntryError as error:
        return EntryProblem(key_hex, "stale", str(error)), None
    namespace_part, token_part = split_key(key)
    if namespace_digest(decoded.namespace) != namespace_part:
        return EntryProblem(key_hex, "mismatched", "header namespace does not match the key"), decoded.namespace
    token_ids = decoded.tensors.get(TOKEN_IDS)
    if token_ids is None or token_ids_digest(token_ids) != token_part:
        return EntryProblem(key_hex, "mismatched", "stored token ids do not match the key"), decoded.namespace
    return None, decoded.namespace


def verify_store(store: SegmentStore) -> VerifyReport:
    """Check every entry; reading does not count as use for LRU."""
    report = VerifyReport()
    for key in store.keys():
        value = store.get(key, touch=False)
        if value is None:
            continue  # removed by another process since the key snapshot
        report.checked += 1
        problem, namespace = check_entry(key, value)
        if problem is not None:
            report.problems.append(problem)
        if namespace is not None:
            report.entries_per_namespace[namespace] += 1
    return report


def collect_garbage(store: LmdbSegmentStore, *, budget_bytes: int | None = None) -> tuple[VerifyReport, GcReport]:
    """Remove entries that fail `verify_store`, then evict least recently used ones down to `budget_bytes`
    (recorded as the store's new budget; default: its current one)."""
    report = verify_store(store)
    if budget_bytes is not None:
        store.set_budget(budget_bytes)
    bad_keys = [bytes.fromhex(problem.key_hex) for problem in report.problems]
    removed = store.batched_remove(bad_keys) if bad_keys else 0
    corrupt = sum(problem.kind == "corrupt" for problem in report.problems)
    store.record_lookups(corrupt=corrupt, mismatched=len(report.problems) - corrupt)
    evicted = store.evict_to(store.budget_bytes)
    store.flush()
    counters = store.counters()
    return report, GcReport(removed, evicted, counters.entries, counters.value_bytes)
