#!/usr/bin/env python
"""Remote cache tier benchmark: what a remote hit, an upload and a failing remote cost. Output: one JSON object.

Per value size (codec values of synthetic entries, so the crc32 and the metadata are real): the median seconds of
an upload (`RemoteTier.put_many`, write-through, so the call waits for it), an idempotent re-upload (one HEAD,
nothing sent), a fetch (`get_many`, one value) and a hit through `SegmentCache` from the remote (fetch, crc32,
decode, fill of LMDB and the hot tier); then the cost of a lookup against a remote that refuses connections, one
that accepts and never answers, and one lookup made while the tier cools down after such a failure.

Without `--endpoint` the S3-compatible server is moto's (started here on 127.0.0.1; needs `moto[server]`): a Python
server in this very process, so the throughput figures are this machine's loopback and moto's, not S3's. With
`--endpoint URL --bucket NAME` it measures a real server (credentials from the usual AWS variables).

    OMP_WAIT_POLICY=PASSIVE python -m hypic_rag.bench.remote_tier --sizes 16 64 --out runs/bench_remote.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hypic_rag.cache.codec import encode_entry
from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.remote_tier import RemoteTier
from hypic_rag.cache.segment_cache import SegmentCache

MIB = 1 << 20
NAMESPACE = CacheNamespace(model_fingerprint="bench", tokenizer_fingerprint="bench", seam_tokens=8)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _entry(size_mib: int, ids: list[int]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(len(ids) + size_mib)
    values = size_mib * MIB // 4
    return {"token_ids": torch.tensor(ids, dtype=torch.int64),
            "layers.0.transition": torch.randn(values, generator=generator)}


def measure_size(endpoint: str, bucket: str, size_mib: int, repeats: int) -> dict[str, Any]:
    ids = list(range(size_mib, size_mib + 32))
    entry = _entry(size_mib, ids)
    value = encode_entry(entry, NAMESPACE.canonical())
    key = segment_key(NAMESPACE, ids)
    result: dict[str, Any] = {"value_mib": round(len(value) / MIB, 2)}
    with RemoteTier.from_url(f"s3://{bucket}/bench", endpoint_url=endpoint, write_behind=False,
                             check_existing=False) as forced:
        result["upload_s"] = _median_seconds(lambda: forced.put_many([(key, value)]), repeats)
    with RemoteTier.from_url(f"s3://{bucket}/bench", endpoint_url=endpoint, write_behind=False) as tier:
        result["idempotent_put_s"] = _median_seconds(lambda: tier.put_many([(key, value)]), repeats)
        result["fetch_s"] = _median_seconds(lambda: tier.get_many([key]), repeats)
    hits = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as directory:
            remote = RemoteTier.from_url(f"s3://{bucket}/bench", endpoint_url=endpoint)
            with SegmentCache.open(directory, namespace=NAMESPACE, remote=remote) as cache:
                began = time.perf_counter()
                found = cache.get_many(NAMESPACE, [ids])[0]
                hits.append(time.perf_counter() - began)
                assert found is not None, "the value was uploaded above"
    result["remote_hit_s"] = statistics.median(hits)
    result["upload_mib_per_s"] = round(result["value_mib"] / result["upload_s"], 1)
    result["fetch_mib_per_s"] = round(result["value_mib"] / result["fetch_s"], 1)
    return result


def measure_failures(bucket: str) -> dict[str, float]:
    """Seconds of one lookup against a refusing and a hung endpoint, and of one made during the cool-down."""
    key = segment_key(NAMESPACE, [1, 2, 3])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed again before use: nothing listens
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    result: dict[str, float] = {}
    try:
        for name, endpoint in (("refused", refused), ("hung", f"http://127.0.0.1:{hung.getsockname()[1]}")):
            with RemoteTier.from_url(f"s3://{bucket}/bench", endpoint_url=endpoint) as tier:
                began = time.perf_counter()
                tier.get_many([key])
                result[f"{name}_first_lookup_s"] = time.perf_counter() - began
                began = time.perf_counter()
                tier.get_many([key])
                result[f"{name}_lookup_while_cooling_down_s"] = time.perf_counter() - began
    finally:
        hung.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="S3-compatible endpoint (default: start moto's server here)")
    parser.add_argument("--bucket", help="bucket to use (default: a new one on the moto server)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64], metavar="MIB", help="value sizes (16 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    server = None
    endpoint, bucket = args.endpoint, args.bucket
    if endpoint is None:
        import boto3
        from moto.server import ThreadedMotoServer

        for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                            ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ.setdefault(name, value)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        endpoint, bucket = f"http://127.0.0.1:{port}", f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    if bucket is None:
        parser.error("--endpoint needs --bucket")
    try:
        report = {
            "server": "moto (in this process, loopback)" if server is not None else endpoint,
            "torch_threads": torch.get_num_threads(),
            "sizes": [measure_size(endpoint, bucket, size, args.repeats) for size in args.sizes],
            "failures": measure_failures(bucket),
        }
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
