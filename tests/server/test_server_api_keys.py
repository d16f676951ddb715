"""API keys (`hypic_rag.server.auth`), on real `hypic-rag serve` subprocesses on 127.0.0.1: without the key every
route but the open ones answers 401 (OpenAI's error shape), a wrong key 401, the right key 200; with an admin key
a read key gets 403 on a document change and the admin key may make it; the key from the environment works; the
key never appears in the server's output or in an error body; an address other than loopback without a key is
refused in one line (exit 2), and served with `--allow-no-key` after a WARNING. (`--workers N`: the front checks
the key, tests/distributed/test_local_workers.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from hypic_rag.server.auth import OPEN_PATHS, ApiKeys, bearer_token, is_loopback, is_open, is_write
from hypic_rag.testing import free_port
from tests.distributed.test_local_workers import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
READ_KEY = "sk-read-7f3e9a1c2b"
ADMIN_KEY = "sk-admin-41d8cd98f0"
WRONG_KEY = "sk-read-7f3e9a1c2c"  # one character off


def server_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HYPIC_RAG_")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **extra}


def start(index: Path, port: int, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port", str(port), "--device", "cpu",
         "--log-level", "info", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )


def stop(process: subprocess.Popen[str]) -> str:
    """SIGTERM, then everything the server wrote."""
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    return out + err


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


READ_CALLS = [
    ("POST", "/v1/ask", {"question": "Who built the bridge?", "top_k": 1, "max_new_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "The river", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2}),
    ("GET", "/v1/cache/stats", None),
    ("GET", "/v1/models", None),
]


def test_keys_checked_on_every_route_but_the_open_ones(tmp_path: Path, copy_tiny_index) -> None:
    index = copy_tiny_index(tmp_path / "index")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start(index, port, "--admin-key", ADMIN_KEY, env=server_env(HYPIC_RAG_API_KEY=READ_KEY))
    bodies: list[str] = []
    try:
        wait_healthy(url, process)
        with httpx.Client(base_url=url, timeout=120) as client:
            model = client.get("/v1/models", headers=bearer(READ_KEY)).json()["data"][0]["id"]
            for method, path, body in READ_CALLS:
                if body is not None and "model" in body:
                    body = {**body, "model": model}
                for headers, expected in (({}, "missing_api_key"), (bearer(WRONG_KEY), "invalid_api_key"),
                                          ({"Authorization": f"Basic {READ_KEY}"}, "missing_api_key")):
                    refused = client.request(method, path, json=body, headers=headers)
                    bodies.append(refused.text)
                    assert refused.status_code == 401, (path, refused.text)
                    assert refused.headers["www-authenticate"] == "Bearer"
                    error = refused.json()["error"]
                    assert error["type"] == "invalid_request_error" and error["code"] == expected, error
                for key in (READ_KEY, ADMIN_KEY):
                    answered = client.request(method, path, json=body, headers=bearer(key))
                    assert answered.status_code == 200, (path, answered.text)
            for path in ("/healthz", "/metrics", "/docs", "/openapi.json"):
                assert client.get(path).status_code == 200, path

            change = {"documents": [{"id": "keyed", "text": "The lighthouse was painted red in spring."}]}
            for headers, status in (({}, 401), (bearer(WRONG_KEY), 401), (bearer(READ_KEY), 403)):
                refused = client.post("/v1/documents", json=change, headers=headers)
                bodies.append(refused.text)
                assert refused.status_code == status, refused.text
            assert refused.json()["error"]["code"] == "permission_denied"
            deleted = client.delete("/v1/documents/keyed", headers=bearer(READ_KEY))
            assert deleted.status_code == 403, deleted.text
            accepted = client.post("/v1/documents", json=change, headers=bearer(ADMIN_KEY))
            assert accepted.status_code == 202, accepted.text
            job = client.get(f"/v1/jobs/{accepted.json()['job_id']}", headers=bearer(READ_KEY))
            assert job.status_code == 200, job.text
    finally:
        output = stop(process)
    assert "Traceback" not in output, output[-2000:]
    for key in (READ_KEY, ADMIN_KEY, WRONG_KEY):
        assert key not in output, "a key was logged"
        assert not [body for body in bodies if key in body], "a key was echoed in an error body"


def test_an_exposed_address_needs_a_key_or_allow_no_key(tmp_path: Path, copy_tiny_index) -> None:
    index = copy_tiny_index(tmp_path / "index")
    refused = subprocess.run(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--host", "0.0.0.0", "--port",
         str(free_port())], capture_output=True, text=True, env=server_env(), cwd=ROOT, timeout=120)
    output = (refused.stdout + refused.stderr).strip()
    assert refused.returncode == 2, output
    assert len(output.splitlines()) == 1 and "--api-key" in output and "--allow-no-key" in output, output

    port = free_port("0.0.0.0")
    process = start(index, port, "--host", "0.0.0.0", "--allow-no-key", "--read-only", env=server_env())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process)  # spoken to through loopback only
        answered = httpx.post(f"http://127.0.0.1:{port}/v1/ask", json=READ_CALLS[0][2], timeout=120)
        assert answered.status_code == 200, answered.text
    finally:
        output = stop(process)
    warnings = [line for line in output.splitlines() if "WARNING" in line and "without an API key" in line]
    assert len(warnings) == 1, output[-2000:]


def test_the_rules_in_one_place() -> None:
    """The open set, the write routes and the permission split, without a server; `serve --help` names the
    environment variables the server reads."""
    from hypic_rag.cli.main import build_parser
    from hypic_rag.server.auth import ADMIN_KEY_ENV, API_KEY_ENV

    usage = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert f"${API_KEY_ENV}" in usage and f"${ADMIN_KEY_ENV}" in usage
    assert {"/healthz", "/", "/docs", "/openapi.json"} <= OPEN_PATHS
    assert is_open("/ui/app.js") and is_open("/metrics") and not is_open("/metrics", metrics_need_key=True)
    assert not is_open("/v1/ask") and not is_open("/uix") and not is_open("/healthz/../v1/ask")
    assert is_write("POST", "/v1/documents") and is_write("DELETE", "/v1/documents/a/b")
    assert not is_write("GET", "/v1/documents/x") and not is_write("POST", "/v1/ask")
    assert bearer_token("Bearer  abc ") == "abc" and bearer_token("bearer abc") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    one = ApiKeys(api_key="k")
    assert one.refusal("POST", "/v1/documents", "Bearer k") is None  # one key: full access
    assert one.refusal("GET", "/v1/cache/stats", "Bearer k2")[0] == 401
    split = ApiKeys(api_key="k", admin_key="a")
    assert split.refusal("DELETE", "/v1/documents/x", "Bearer k")[0] == 403
    assert split.refusal("DELETE", "/v1/documents/x", "Bearer a") is None
    assert split.refusal("POST", "/v1/ask", "Bearer a") is None
    assert "k" not in repr(split).replace("key", "").replace("metrics", "")
    assert ApiKeys().refusal("POST", "/v1/documents", None) is None
    for host, loopback in (("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("localhost", True),
                           ("0.0.0.0", False), ("::", False), ("192.168.1.4", False), ("example.org", False)):
        assert is_loopback(host) is loopback, host


@pytest.mark.parametrize("bad", ["", "has space", "tab\tkey", "ключ"])
def test_a_key_a_header_cannot_carry_is_refused_without_echo(bad: str) -> None:
    from hypic_rag.server import ServerConfig

    with pytest.raises(ValueError) as raised:
        ServerConfig(index_dir=Path("x"), api_key=bad)
    assert "api_key" in str(raised.value) and (not bad or bad not in str(raised.value))


def test_replicas_run_without_keys_behind_the_front_that_checks_them() -> None:
    from hypic_rag.server import ServerConfig

    config = ServerConfig(index_dir=Path("x"), api_key=READ_KEY, admin_key=ADMIN_KEY)
    assert config.keys.enabled and READ_KEY not in repr(config) and ADMIN_KEY not in repr(config)
    replica = config.for_replica("worker-0")
    assert replica.api_key is None and replica.admin_key is None and not replica.keys.enabled
