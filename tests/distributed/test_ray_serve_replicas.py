"""`hypic-rag serve --replicas 2 --ray ADDRESS --remote-cache ... --cache DIR/{replica}` (one real subprocess for
the whole module; its replicas are Ray Serve deployments on the session's local cluster, each with a local cache
of its own, as on two hosts, over one shared remote tier on a local S3 server) against one single-process server
on a copy of the same index: the same answers, streams and completions; each request served by the replica that
owns most of its retrieved chunks (rendezvous), so repeated requests for the same chunks hit that replica's hot
tier and never touch the other's; an entry one replica encodes is a remote hit on the other; document changes
refused (replicas are read-only); a clean SIGTERM stop removes the replicas."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hypic_rag.distributed.front import completion_keys
from hypic_rag.distributed.rendezvous import RendezvousRouter, owner
from hypic_rag.server.config import ServerConfig
from hypic_rag.server.runner import ServerThread
from hypic_rag.testing import free_port
from kits.corpora import SMALL_CORPUS_QUESTIONS
from kits.s3 import TEST_AWS_ENV

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
REPLICAS = ["hypic-replica-0", "hypic-replica-1"]
SEPARATOR = "<<PIC_SEP>>"


@pytest.fixture(scope="module")
def replicated(ray_address: str, local_s3: Any, tmp_path_factory: pytest.TempPathFactory,
               copy_tiny_index) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("replicated")
    index = copy_tiny_index(base / "index")
    for replica in REPLICAS:  # each replica's "host" starts with the index's entries, as a copied index would
        shutil.copytree(index / "segment_cache", base / "caches" / replica)
    bucket = local_s3.new_bucket()
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1",
               **TEST_AWS_ENV)
    process = subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port", str(port), "--device", "cpu",
         "--replicas", "2", "--ray", ray_address, "--replica-cpus", "0.5", "--log-level", "warning",
         "--cache", str(base / "caches" / "{replica}"), "--remote-cache", f"s3://{bucket}/segments",
         "--remote-endpoint", local_s3.url],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the replicas did not come up"
            try:
                if httpx.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield {"url": url, "process": process, "bucket": bucket, "caches": base / "caches"}
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Iterator[str]:
    index = copy_tiny_index(tmp_path_factory.mktemp("single") / "index")
    with ServerThread(ServerConfig(index_dir=index, device="cpu", read_only=True)) as server:
        yield server.url


def ask(url: str, question: str, **options: Any) -> httpx.Response:
    response = httpx.post(f"{url}/v1/ask", json={"question": question, "max_new_tokens": 8, **options}, timeout=120)
    assert response.status_code == 200, response.text
    return response


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    return {"answer": body["answer"], "finish_reason": body["finish_reason"], "usage": body["usage"],
            "sources": [(source["chunk_id"], round(source["score"], 5)) for source in body["sources"]]}


def replica_stats(url: str) -> dict[str, dict[str, int]]:
    body = httpx.get(f"{url}/v1/cache/stats", timeout=60).json()
    assert [replica["replica"] for replica in body["replicas"]] == REPLICAS
    return {replica["replica"]: replica["cache"] for replica in body["replicas"]}


def test_two_replicas_answer_as_one_server_routed_by_chunk_affinity(replicated: dict[str, Any], single: str) -> None:
    url = replicated["url"]
    router = RendezvousRouter(REPLICAS)  # the front's rule, with nothing in flight (requests one at a time)
    for question in SMALL_CORPUS_QUESTIONS.values():
        front, alone = ask(url, question), ask(single, question)
        assert comparable(front.json()) == comparable(alone.json())
        chunk_ids = [source["chunk_id"] for source in front.json()["sources"]]
        assert front.headers["x-hypic-replica"] == router.choose(chunk_ids).replica
    health = httpx.get(f"{url}/healthz", timeout=60).json()
    assert health["status"] == "ok" and [r["replica"] for r in health["replicas"]] == REPLICAS


def test_repeated_requests_for_the_same_chunks_hit_one_replicas_hot_tier(replicated: dict[str, Any]) -> None:
    url = replicated["url"]
    question = SMALL_CORPUS_QUESTIONS["volcano.md"]
    before = replica_stats(url)
    replicas = {ask(url, question).headers["x-hypic-replica"] for _ in range(3)}
    assert len(replicas) == 1
    (target,) = replicas
    (other,) = [name for name in REPLICAS if name != target]
    after = replica_stats(url)
    lookups = lambda stats: stats["hot_hits"] + stats["disk_hits"]  # noqa: E731
    assert after[other]["hot_hits"] == before[other]["hot_hits"] and lookups(after[other]) == lookups(before[other])
    assert after[target]["hot_hits"] - before[target]["hot_hits"] >= 2 * 5  # prefix + 4 chunks, twice from memory
    routed = httpx.get(f"{url}/v1/cache/stats", timeout=60).json()["router"]["routed"]
    assert routed[target] >= 3


def test_streams_and_completions_pass_through_unchanged(replicated: dict[str, Any], single: str) -> None:
    url = replicated["url"]
    question = SMALL_CORPUS_QUESTIONS["chess.md"]
    with httpx.stream("POST", f"{url}/v1/ask", json={"question": question, "max_new_tokens": 8, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[0]["type"] == "sources" and events[-1]["type"] == "done"
    streamed = "".join(event["text"] for event in events if event["type"] == "token")
    assert streamed == events[-1]["answer"] == ask(single, question).json()["answer"]

    prompt = "The ferry leaves at noon.\n<<PIC_SEP>>The mill has a tower.\n<<PIC_SEP>>When does the ferry leave?"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    front = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    alone = httpx.post(f"{single}/v1/completions", json=body, timeout=120)
    assert front.status_code == alone.status_code == 200
    assert front.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert again.headers["x-hypic-replica"] == front.headers["x-hypic-replica"]  # same segments, same replica
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_replicas_refuse_document_changes_and_bad_input_as_one_server(replicated: dict[str, Any], single: str) -> None:
    url = replicated["url"]
    added = httpx.post(f"{url}/v1/documents", json={"documents": [{"id": "x", "text": "y"}]}, timeout=60)
    assert added.status_code == 409
    for body in ({"question": ""}, {"question": "x", "top_k": 0}, {"nothing": 1}):
        front = httpx.post(f"{url}/v1/ask", json=body, timeout=60)
        alone = httpx.post(f"{single}/v1/ask", json=body, timeout=60)
        assert front.status_code == alone.status_code and front.status_code in (400, 422)
        assert front.json()["error"]["type"] == alone.json()["error"]["type"]
    assert httpx.post(f"{url}/v1/ask", content=b"x" * (9 << 20), timeout=60).status_code == 413
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert 'hypic_front_routed_total{replica="hypic-replica-0"}' in metrics


def owned_texts(count_by_replica: dict[str, int]) -> dict[str, list[str]]:
    """Sentences not in the index whose completion affinity key is owned by each replica, `count` each."""
    found: dict[str, list[str]] = {replica: [] for replica in count_by_replica}
    number = 0
    while any(len(found[r]) < n for r, n in count_by_replica.items()):
        text = f"The signal tower number {number} was painted copper in winter.\n"
        (key,) = completion_keys({"prompt": f"{text}{SEPARATOR}q"}, SEPARATOR)
        replica = owner(REPLICAS, key)
        if len(found[replica]) < count_by_replica[replica]:
            found[replica].append(text)
        number += 1
    return found


def wait_for_uploads(url: str, replica: str, at_least: int) -> dict[str, Any]:
    """`replica`'s cache stats once its write-behind queue is empty and it has uploaded `at_least` entries."""
    deadline = time.monotonic() + 60
    while True:
        stats = replica_stats(url)[replica]
        if stats["remote_queue_entries"] == 0 and stats["remote_puts"] >= at_least:
            return stats
        assert time.monotonic() < deadline, f"{replica} never uploaded: {stats}"
        time.sleep(0.2)


def test_an_entry_one_replica_encodes_is_a_remote_hit_on_the_other(
    replicated: dict[str, Any], single: str, local_s3: Any
) -> None:
    """Replica X encodes segment A (a miss everywhere) and uploads it; a request routed to replica Y (B and C are
    Y's) finds A in neither Y's hot tier nor its own disk, and takes it from the remote: one remote hit, no
    encoding of A, the single server's answer."""
    url = replicated["url"]
    texts = owned_texts({REPLICAS[0]: 1, REPLICAS[1]: 2})
    (shared,), (b, c) = texts[REPLICAS[0]], texts[REPLICAS[1]]
    x, y = REPLICAS
    before = replica_stats(url)
    objects_before = len(local_s3.objects(replicated["bucket"]))

    first = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": f"{shared}{SEPARATOR}What colour is the tower?", "max_tokens": 4, "temperature": 0})
    assert first.status_code == 200 and first.headers["x-hypic-replica"] == x, first.text
    assert first.json()["usage"]["encoded_tokens"] > 0  # A was encoded there
    uploaded = wait_for_uploads(url, x, before[x]["remote_puts"] + 1)
    assert uploaded["remote_errors"] == 0 and uploaded["remote_available"] is True
    assert len(local_s3.objects(replicated["bucket"])) > objects_before  # in the shared bucket now

    middle = replica_stats(url)
    body = {"prompt": f"{shared}{SEPARATOR}{b}{SEPARATOR}{c}{SEPARATOR}What colour is the tower?",
            "max_tokens": 4, "temperature": 0}
    second = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert second.status_code == 200 and second.headers["x-hypic-replica"] == y, second.text
    after = replica_stats(url)
    assert after[y]["remote_hits"] - middle[y]["remote_hits"] == 1  # A, uploaded by x
    assert second.json()["usage"]["encoded_tokens"] > 0  # B and C: held nowhere (a lookup that counts nothing) ...
    assert wait_for_uploads(url, y, middle[y]["remote_puts"] + 2)["remote_errors"] == 0  # ... encoded by y, uploaded
    assert after[y]["disk_hits"] == middle[y]["disk_hits"]  # y's own disk never held A
    lookups = ("hot_hits", "disk_hits", "remote_hits", "remote_misses", "remote_puts")
    assert [after[x][k] for k in lookups] == [middle[x][k] for k in lookups]  # x took no part
    alone = httpx.post(f"{single}/v1/completions", json=body, timeout=120)
    assert second.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    merged = httpx.get(f"{url}/v1/cache/stats", timeout=60).json()["cache"]
    assert merged["remote_hits"] == sum(after[r]["remote_hits"] for r in REPLICAS)  # per-process: summed
    assert sorted(Path(path).resolve() for path in merged["paths"]) == \
        sorted((replicated["caches"] / r).resolve() for r in REPLICAS)
    assert merged["entries"] == sum(after[r]["entries"] for r in REPLICAS)  # two stores: summed


def test_sigterm_stops_the_front_and_removes_the_replicas(replicated: dict[str, Any], ray_cluster: Any,
                                                          beyond_loopback: Any) -> None:
    from ray import serve

    process = replicated["process"]
    addresses, elsewhere = beyond_loopback(process.pid)
    assert len(addresses) >= 2 and elsewhere == {}, addresses  # the front and the driver: on 127.0.0.1 only
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, process.communicate()[1][-3000:]
    applications = serve.status().applications
    assert not any(name.startswith("hypic-replica-") for name in applications)
