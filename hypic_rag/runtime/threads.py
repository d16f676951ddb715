"""Intra-op threads for passes over few rows on CPU: small operations on one thread, large products on all of them.

A hypic prefill recomputes a few dozen rows (seam windows and the question) and runs thousands of small torch
operations on them (norms, gates, the conv, the scan's batched products, the state compositions). Each of those
opens an OpenMP parallel region; under `OMP_WAIT_POLICY=PASSIVE` (what the CLI sets, and what a shared machine needs)
the pool's threads sleep between regions, so every small operation pays for waking them (docs/runtime.md has the
measurements). The few large operations of such a pass (the linear layers, attention over every cached key) still
want every thread.

`serial_section(size)` runs a pass over at most `SERIAL_MAX_ROWS` rows (or other small work, with the caller's own
limit: the packed delta-rule scan) with ONE intra-op thread, and `wide()` / `wide_for(multiply_adds)` give one large
operation back the full count inside it: attention and the products of large states through `wide_for`, the oneDNN
linears by their weight size (`fast_linear`). Outside a section they do nothing, so the functions that call them
behave as before everywhere else (GPU, long prefills, encoding).
The thread count is per OS thread in OpenMP, so the state here is thread-local: a server's worker thread and a
caller's thread do not see each other's sections. HYPIC_RAG_SERIAL_SMALL_OPS=0 turns sections off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

SERIAL_MAX_ROWS = 256
"""Passes over at most this many token rows run their small operations on one thread (`serial_section`). Above it,
elementwise work per operation is large enough for a second thread to pay for waking it (a full prefill of 2,000
tokens keeps every thread throughout)."""

_local = threading.local()


def serial_enabled() -> bool:
    """Whether `serial_section` may narrow the thread count (HYPIC_RAG_SERIAL_SMALL_OPS, default on)."""
    return os.environ.get("HYPIC_RAG_SERIAL_SMALL_OPS", "1").strip().lower() not in ("0", "false", "no", "off")


def wide_threads() -> int | None:
    """The full intra-op thread count while this thread is inside a `serial_section`, else None."""
    return getattr(_local, "wide", None)


@contextmanager
def serial_section(size: int, device: torch.device | str = "cpu", limit: int = SERIAL_MAX_ROWS) -> Iterator[None]:
    """One intra-op thread for the block when its work is small: `size` <= `limit` (by default the pass's token rows
    against `SERIAL_MAX_ROWS`; a caller may count something else, e.g. a scan's elements, with its own limit), on CPU,
    with more than one thread configured. The previous count is restored afterwards, also on error. Nested sections
    and every other case are no-ops."""
    threads = torch.get_num_threads()
    if (
        torch.device(device).type != "cpu" or size > limit or threads <= 1 or wide_threads() is not None
        or not serial_enabled()
    ):
        yield
        return
    _local.wide = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _local.wide = None


WIDE_MIN_MULTIPLY_ADDS = 1 << 24
"""A product inside a serial section gets every thread (`wide_for`) from about this many multiply-adds on
(docs/runtime.md, "CPU measurements behind the runtime's constants")."""


def wide_for(multiply_adds: int):
    """`wide()` for a product of at least `WIDE_MIN_MULTIPLY_ADDS`, else a no-op context."""
    return wide() if multiply_adds >= WIDE_MIN_MULTIPLY_ADDS and wide_threads() is not None else nullcontext()


@contextmanager
def wide() -> Iterator[None]:
    """Every configured thread for one large operation inside a `serial_section`; a no-op outside one."""
    threads = wide_threads()
    if threads is None:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(1)
