"""The rendezvous (HRW) router: stable assignment, balance, minimal movement when replicas change, load as the
tie-break and overflow. Pure Python: no Ray needed."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from hypic_rag.distributed.rendezvous import NoReplicaAvailable, RendezvousRouter, owner, weight

REPLICAS = [f"replica-{number}" for number in range(4)]


def chunk_ids(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x}" for _ in range(count)]


def test_assignment_is_a_pure_function_of_replicas_and_chunks() -> None:
    keys = chunk_ids(200)
    first = RendezvousRouter(REPLICAS)
    second = RendezvousRouter(list(reversed(REPLICAS)))  # another process, replicas listed in another order
    for start in range(0, 200, 4):
        request = keys[start : start + 4]
        assert first.choose(request).replica == second.choose(request).replica
        assert first.choose(list(reversed(request))).replica == first.choose(request).replica  # order-free
    assert weight("replica-0", "abc") == weight("replica-0", "abc") != weight("replica-1", "abc")


def test_ownership_is_balanced() -> None:
    keys = chunk_ids(20_000, seed=1)
    counts = Counter(owner(REPLICAS, key) for key in keys)
    expected = len(keys) / len(REPLICAS)
    assert set(counts) == set(REPLICAS)
    assert all(abs(count - expected) < 0.05 * expected for count in counts.values()), counts


def test_adding_or_removing_a_replica_moves_only_its_chunks() -> None:
    keys = chunk_ids(8_000, seed=2)
    before = {key: owner(REPLICAS, key) for key in keys}
    grown = REPLICAS + ["replica-4"]
    after = {key: owner(grown, key) for key in keys}
    moved = [key for key in keys if after[key] != before[key]]
    assert all(after[key] == "replica-4" for key in moved)  # nothing moves between the old replicas
    assert abs(len(moved) / len(keys) - 1 / 5) < 0.03
    shrunk = [replica for replica in REPLICAS if replica != "replica-2"]
    moved = [key for key in keys if owner(shrunk, key) != before[key]]
    assert {before[key] for key in moved} == {"replica-2"}  # only replica-2's chunks move


def test_a_request_goes_to_the_replica_owning_most_of_its_chunks() -> None:
    router = RendezvousRouter(REPLICAS)
    keys = chunk_ids(400, seed=3)
    by_owner: dict[str, list[str]] = {}
    for key in keys:
        by_owner.setdefault(owner(REPLICAS, key), []).append(key)
    request = by_owner["replica-1"][:3] + by_owner["replica-3"][:1]
    decision = router.choose(request)
    assert decision.replica == decision.affine == "replica-1" and not decision.overflowed
    assert decision.owned == {"replica-0": 0, "replica-1": 3, "replica-2": 0, "replica-3": 1}


def test_load_breaks_ties_and_overflow_moves_to_the_next_ranked() -> None:
    router = RendezvousRouter(REPLICAS[:2], max_in_flight=2)
    keys = chunk_ids(400, seed=4)
    owned = {replica: [key for key in keys if owner(REPLICAS[:2], key) == replica] for replica in REPLICAS[:2]}
    tie = [owned["replica-0"][0], owned["replica-1"][0]]  # one chunk each: a tie broken by load
    with router.routed(owned["replica-0"][1:3]) as busy:
        assert busy.replica == "replica-0"
        assert router.choose(tie).replica == "replica-1"  # replica-0 has one in flight
        with router.routed(owned["replica-0"][3:5]) as second:
            assert second.replica == "replica-0" and not second.overflowed
            overflow = router.choose(owned["replica-0"][5:7])  # replica-0 is at max_in_flight
            assert overflow.replica == "replica-1" and overflow.affine == "replica-0" and overflow.overflowed
    assert router.choose(owned["replica-0"][5:7]).replica == "replica-0"  # back once the load is gone
    assert router.snapshot()["in_flight"] == {"replica-0": 0, "replica-1": 0}
    assert router.choose([]).affine is None  # no chunks: the least loaded replica, no affinity


def test_when_every_replica_is_busy_the_least_loaded_is_taken() -> None:
    router = RendezvousRouter(REPLICAS[:2], max_in_flight=1)
    keys = chunk_ids(100, seed=5)
    target = owner(REPLICAS[:2], keys[0])
    other = next(replica for replica in REPLICAS[:2] if replica != target)
    with router.routed([keys[0]]), router.routed([keys[0]]) as spilled:
        assert spilled.replica == other
        with router.routed([keys[0]]) as third:  # both at the limit, one each: the affine one again
            assert third.replica == target
        assert router.snapshot()["routed"] == {target: 2, other: 1}


def test_concurrent_routing_keeps_counts_consistent() -> None:
    router = RendezvousRouter(REPLICAS, max_in_flight=3)
    keys = chunk_ids(64, seed=6)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            with router.routed(rng.sample(keys, 4)):
                pass

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    snapshot = router.snapshot()
    assert sum(snapshot["routed"].values()) == 1600 and set(snapshot["in_flight"].values()) == {0}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RendezvousRouter([])
    with pytest.raises(ValueError):
        RendezvousRouter(["a", "a"])
    with pytest.raises(ValueError):
        RendezvousRouter(["a"], max_in_flight=0)


def test_a_replica_out_of_rotation_is_passed_over_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    router = RendezvousRouter(["a", "b"])
    keys = [key for key in (f"chunk-{number}" for number in range(50)) if owner(["a", "b"], key) == "a"][:3]
    assert router.choose(keys).replica == "a"
    with caplog.at_level("WARNING", logger="hypic_rag.distributed.rendezvous"):
        assert router.mark_down("a", "its process exited with code -9")
        for _ in range(100):  # every request while it is down: no log line each
            assert not router.mark_down("a", "unreachable (ConnectError)")
            decision = router.acquire(keys)
            assert decision.replica == "b"
            router.release(decision)
        assert router.snapshot()["down"] == ["a"]
        assert router.mark_down("b", "its process exited with code 1")
        with pytest.raises(NoReplicaAvailable, match="exited with code"):
            router.acquire(keys)
        assert router.mark_up("a") and not router.mark_up("a")
    assert router.choose(keys).replica == "a"
    assert len(caplog.records) == 3, [record.getMessage() for record in caplog.records]



def test_an_avoided_replica_is_taken_only_when_every_other_is_down_or_at_its_limit() -> None:
    """`avoid` (the index's owner while it has document jobs): passed over, whatever the keys' affinity or the load,
    while another replica in rotation has room; then chosen as if nothing were avoided, never refused."""
    router = RendezvousRouter(["a-owner", "b", "c"], max_in_flight=2)
    keys = [key for key in chunk_ids(300, seed=7) if owner(router.replicas, key) == "a-owner"][:3]
    assert router.choose(keys).replica == "a-owner"
    held = [router.acquire(keys, avoid="a-owner") for _ in range(4)]  # b and c fill up to their limit, owner idle
    assert sorted(decision.replica for decision in held) == ["b", "b", "c", "c"]
    assert not any(decision.overflowed for decision in held) and {decision.affine for decision in held} == {"a-owner"}
    spilled = router.acquire(keys, avoid="a-owner")  # every other one at its limit: the owner has room, it serves
    assert spilled.replica == "a-owner"
    router.release(held.pop())
    assert router.choose(keys, avoid="a-owner").replica in {"b", "c"}  # room again elsewhere
    for decision in (*held, spilled):
        router.release(decision)
    router.mark_down("b", "its process exited with code -9")
    router.mark_down("c", "its process exited with code -9")
    assert router.choose([], avoid="a-owner").replica == "a-owner"  # the only one running: never a 503 for avoiding
    router.mark_up("c")
    assert router.choose([], avoid="a-owner").replica == "c"
    assert router.choose([], avoid=None).replica == "a-owner"  # nothing avoided: the tie goes by name
    assert router.snapshot()["in_flight"] == {"a-owner": 0, "b": 0, "c": 0}
