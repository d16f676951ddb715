"""Rendezvous (highest random weight) routing of requests to replicas by the chunks they will compose.

Each chunk id has an owner among the replicas: the replica with the highest weight `hash(replica, chunk)`. A
request goes to the replica owning the most of its chunks, so a chunk's entry is loaded into one replica's hot
tier and found there by every later request that retrieves it, wherever it sits in the prompt and whatever its
neighbours (a prefix-based router, keyed on the prompt's first tokens, sends two orders of the same chunks to
two replicas). Ties (as many chunks owned by two replicas, or no chunk at all) go to the replica with fewer
requests in flight, then to the higher summed weight (deterministic). Overflow: a replica already running
`max_in_flight` requests is passed over for the next-ranked one below it; when all are that busy, the least loaded
one is taken.

Avoiding a replica (`acquire(keys, avoid=...)`: the front passes the index's owner while it has document jobs
pending, so its jobs are not starved by questions): the avoided replica is passed over while any other replica in
rotation has room below `max_in_flight`; when every other one is down or at its limit, the choice is made as if
nothing were avoided (the request is still served, never refused for it).

Out of rotation: a replica marked down (`mark_down`: its process died, or it refused a connection) is passed over
until `mark_up`; its keys go to the next-ranked replica meanwhile. Each change is logged once, whatever the
number of requests it turns away. When every replica is down, `acquire` raises `NoReplicaAvailable`.

Why rendezvous hashing: adding or removing a replica moves only the chunks it gains or loses (about 1/N of
them), with no ring or virtual nodes to tune, and the ownership of N replicas is uniform in expectation.

Pure Python, no Ray: `front.py` routes with it, the tests check it directly.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hypic_rag.errors import HypicError

logger = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 4
"""Requests a replica runs (or queues) before the router sends its affine requests to the next-ranked replica."""


def weight(replica: str, key: str) -> int:
    """The rendezvous weight of `key` on `replica`: 64 bits of blake2b over both (stable across processes and runs)."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, key=replica.encode("utf-8")[:64])
    return int.from_bytes(digest.digest(), "big")


def owner(replicas: Sequence[str], key: str) -> str:
    """The replica that owns `key`: the highest weight (ties, which 64-bit weights make rare, by name)."""
    if not replicas:
        raise ValueError("no replicas to route to")
    return max(replicas, key=lambda replica: (weight(replica, key), replica))


class NoReplicaAvailable(HypicError):
    """Every replica is out of rotation (all died or are restarting); the front answers 503 (never a CLI exit)."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where a request went and why: `replica` chosen, `owned` (chunks it owns per replica), `affine` (the
    replica the chunks alone pointed at, None without chunks), `overflowed` (the affine one was too busy)."""

    replica: str
    owned: dict[str, int]
    affine: str | None
    overflowed: bool


class RendezvousRouter:
    """Chooses a replica per request by its chunk ids and tracks requests in flight per replica (thread-safe).

        router = RendezvousRouter(["replica-0", "replica-1"])
        with router.routed(chunk_ids) as decision:     # counts the request in flight until the block ends
            forward(request, decision.replica)
    """

    def __init__(self, replicas: Sequence[str], *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError("replica names must be distinct")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.replicas = list(replicas)
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._in_flight = dict.fromkeys(self.replicas, 0)
        self._routed = dict.fromkeys(self.replicas, 0)
        self._overflowed = 0
        self._down: dict[str, str] = {}  # replica -> why it is out of rotation

    def mark_down(self, replica: str, reason: str) -> bool:
        """Take `replica` out of rotation (logged once per change, at WARNING); True when it was in rotation."""
        with self._lock:
            if replica in self._down or replica not in self._in_flight:
                return False
            self._down[replica] = reason
        logger.warning("%s out of rotation: %s", replica, reason)
        return True

    def mark_up(self, replica: str) -> bool:
        """Put `replica` back in rotation (logged once per change); True when it was out."""
        with self._lock:
            if self._down.pop(replica, None) is None:
                return False
        logger.warning("%s back in rotation", replica)
        return True

    def is_down(self, replica: str) -> bool:
        with self._lock:
            return replica in self._down

    def ranking(self, keys: Sequence[str], in_flight: dict[str, int] | None = None) -> list[str]:
        """Every replica, best first for a request over `keys`: most owned keys, then fewer in flight, then the
        higher summed weight, then the name."""
        in_flight = self._in_flight if in_flight is None else in_flight
        distinct = list(dict.fromkeys(keys))
        owned = self._owned(distinct)
        summed = {replica: sum(weight(replica, key) for key in distinct) for replica in self.replicas}
        return sorted(self.replicas,
                      key=lambda r: (-owned[r], in_flight.get(r, 0), -summed[r], r))

    def choose(self, keys: Sequence[str], *, avoid: str | None = None) -> RouteDecision:
        """The replica for a request over `keys` (chunk ids, or any affinity keys), under the current load, passing
        over `avoid` while another replica has room (module docstring); does not count it in flight (see `routed`)."""
        with self._lock:
            return self._choose(keys, avoid)

    def _owned(self, keys: Sequence[str]) -> dict[str, int]:
        owned = dict.fromkeys(self.replicas, 0)
        for key in dict.fromkeys(keys):
            owned[owner(self.replicas, key)] += 1
        return owned

    def _choose(self, keys: Sequence[str], avoid: str | None = None) -> RouteDecision:
        ranking = [replica for replica in self.ranking(keys, self._in_flight) if replica not in self._down]
        if not ranking:
            raise NoReplicaAvailable(f"no replica is running ({'; '.join(sorted(set(self._down.values())))})")
        owned = self._owned(keys)
        affine = ranking[0] if keys else None
        others = [replica for replica in ranking if replica != avoid]
        if len(others) < len(ranking) and any(self._in_flight[replica] < self.max_in_flight for replica in others):
            ranking = others  # the avoided replica only when every other one is down or at its limit
        for replica in ranking:
            if self._in_flight[replica] < self.max_in_flight:
                return RouteDecision(replica, owned, affine, overflowed=replica != ranking[0])
        least = min(ranking, key=lambda r: (self._in_flight[r], ranking.index(r)))  # all busy: least loaded
        return RouteDecision(least, owned, affine, overflowed=least != ranking[0])

    def acquire(self, keys: Sequence[str], *, avoid: str | None = None) -> RouteDecision:
        """Choose a replica in rotation (passing over `avoid` while another has room) and count the request in
        flight on it until `release(decision)`; `NoReplicaAvailable` when every one is down."""
        with self._lock:
            decision = self._choose(keys, avoid)
            self._in_flight[decision.replica] += 1
            self._routed[decision.replica] += 1
            self._overflowed += decision.overflowed
        return decision

    def acquire_on(self, replica: str) -> RouteDecision:
        """Count a request in flight on `replica` itself (a request only it may serve: the index owner's document
        routes) until `release(decision)`; `NoReplicaAvailable` while it is out of rotation."""
        with self._lock:
            if replica not in self._in_flight:
                raise ValueError(f"unknown replica {replica!r}")
            if replica in self._down:
                raise NoReplicaAvailable(f"{replica} is not running ({self._down[replica]})")
            self._in_flight[replica] += 1
            self._routed[replica] += 1
        return RouteDecision(replica, {}, replica, overflowed=False)

    def release(self, decision: RouteDecision) -> None:
        """The request `acquire` routed has finished (its response ended or failed)."""
        with self._lock:
            self._in_flight[decision.replica] -= 1

    @contextmanager
    def routed(self, keys: Sequence[str]) -> Iterator[RouteDecision]:
        """Choose a replica and count the request in flight on it until the block ends."""
        decision = self.acquire(keys)
        try:
            yield decision
        finally:
            self.release(decision)

    def snapshot(self) -> dict[str, object]:
        """Requests routed and in flight per replica, and how many overflowed past their affine replica."""
        with self._lock:
            return {"routed": dict(self._routed), "in_flight": dict(self._in_flight), "overflowed": self._overflowed,
                    "max_in_flight": self.max_in_flight, "down": sorted(self._down)}
