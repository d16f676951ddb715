"""A local S3-compatible server for tests of the remote cache tier: moto's server mode on 127.0.0.1.

    with aws_test_environment():          # the standard AWS variables, set to the local server's test values
        server = LocalS3()                 # listening on 127.0.0.1:<free port>, in a thread of this process
        bucket = server.new_bucket()
        ... RemoteTierConfig.from_url(f"s3://{bucket}/segments", endpoint_url=server.url) ...
        server.stop()

moto keeps its buckets in the process that runs it, so several `LocalS3` on other ports serve the same buckets
and each can be stopped on its own (a remote going away). Needs the test extra (moto[server], boto3); nothing
here imports them until a server is made.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypic_rag.testing.tiny import free_port

TEST_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
"""Credentials and settings the local server accepts (standard AWS variables; no profile, no instance metadata)."""
CLEARED_AWS_VARIABLES = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")


@contextmanager
def aws_test_environment() -> Iterator[dict[str, str]]:
    """`os.environ` with `TEST_AWS_ENV` set and the variables that would point elsewhere removed (restored after);
    yields the variables set."""
    saved = {name: os.environ.get(name) for name in (*TEST_AWS_ENV, *CLEARED_AWS_VARIABLES)}
    os.environ.update(TEST_AWS_ENV)
    for name in CLEARED_AWS_VARIABLES:
        os.environ.pop(name, None)
    try:
        yield dict(TEST_AWS_ENV)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class LocalS3:
    """moto's S3 server in a thread of this process, on 127.0.0.1 (all instances share their buckets)."""

    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = port or free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        """A boto3 S3 client of this server (credentials from the environment: `aws_test_environment`)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=TEST_AWS_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=TEST_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
                            region_name=TEST_AWS_ENV["AWS_DEFAULT_REGION"])

    def new_bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"hypic-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """Every object under `prefix` in `bucket`: name -> bytes."""
        client = self.client()
        found: dict[str, bytes] = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", ()):
                found[item["Key"]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        return found

    def stop(self) -> None:
        self._server.stop()
