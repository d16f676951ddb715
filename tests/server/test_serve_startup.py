"""`hypic-rag serve` start-up failures, in real subprocesses: each prints exactly one line (no traceback) and exits
with the code docs/service.md states: 3 an index built for another model; 1 the index's writer lock held by
another process, the port in use, an unreadable manifest. The port and the lock are checked before the model is
loaded: given a model that cannot load, the port or lock error is still the one reported."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hypic_rag.testing import free_port
from kits.corpora import SMALL_CORPUS
from hypic_rag.testing import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory, copy_tiny_index) -> Path:
    return copy_tiny_index(tmp_path_factory.mktemp("serve_startup") / "index")


@pytest.fixture(scope="module")
def unloadable_model(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """A model directory whose config.json is fine but which has no weights: loading it fails."""
    directory = tmp_path_factory.mktemp("unloadable_model")
    shutil.copy(model / "config.json", directory / "config.json")
    return directory


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "hypic_rag", "serve", "--log-level", "warning", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S, cwd=ROOT)


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == code, output
    assert "Traceback" not in output, output
    assert len(output.splitlines()) == 1, output
    assert output.startswith("hypic-rag serve: error: "), output
    for fragment in fragments:
        assert fragment in output, output


@pytest.mark.parametrize("ray", ["auto", "127.0.0.1:1"])
def test_ray_without_replicas_or_encode_actors_is_refused(index: Path, ray: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`serve --ray ADDRESS` alone started and served, ignoring --ray without a word; now refused before anything
    is opened (the address is not even tried)."""
    from hypic_rag.cli.main import main

    assert main(["serve", "--index", str(index), "--ray", ray, "--port", str(free_port())]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "--ray names the Ray cluster for --replicas N" in captured.err


def test_an_index_built_for_another_model_exits_3(tmp_path: Path, index: Path) -> None:
    other = save_tiny_checkpoint(tmp_path / "other_model", list(SMALL_CORPUS.values()) * 4, seed=1)
    result = serve("--index", str(index), "--model", str(other), "--port", str(free_port()))
    assert_one_line(result, 3, "index was built for model", str(other))


def test_a_held_index_lock_exits_1_before_loading_the_model(index: Path, unloadable_model: Path) -> None:
    with (index / "index.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running precompute or writer server holds it
        result = serve("--index", str(index), "--model", str(unloadable_model), "--port", str(free_port()))
    assert_one_line(result, 1, "being written by another process", "--read-only")


def test_a_port_in_use_exits_1_before_loading_the_model(index: Path, unloadable_model: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve("--index", str(index), "--model", str(unloadable_model), "--port", str(port), "--read-only")
    assert_one_line(result, 1, f"127.0.0.1:{port}", "address already in use", "--port")


def test_a_corrupt_manifest_exits_1(tmp_path: Path, index: Path, model: Path) -> None:
    broken = tmp_path / "index"
    shutil.copytree(index, broken, ignore=shutil.ignore_patterns("index.lock"))
    (broken / "manifest.json").write_text('{"embedder": {"name": ', encoding="utf-8")
    for extra in ((), ("--model", str(model))):
        result = serve("--index", str(broken), "--port", str(free_port()), *extra)
        assert_one_line(result, 1, "cannot read", "manifest.json")


def test_a_model_that_cannot_load_is_one_line(index: Path, unloadable_model: Path) -> None:
    result = serve("--index", str(index), "--model", str(unloadable_model), "--port", str(free_port()), "--read-only")
    output = (result.stdout + result.stderr).strip()
    assert result.returncode in (1, 2), output
    assert "Traceback" not in output and len(output.splitlines()) == 1, output


def test_weights_that_fail_to_load_in_a_worker_are_one_line(tmp_path: Path, index: Path, model: Path) -> None:
    """`--workers 2`: the model loads in the worker processes; the first one's failure is the one line, with the
    exit code the single server gives the same failure (2: weights that cannot load; it was 1 whatever the cause),
    and no worker is left running."""
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    result = serve("--index", str(index), "--model", str(broken), "--port", str(free_port()), "--workers", "2")
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, output
    assert "Traceback" not in output and len(output.splitlines()) == 1, output
    assert output.startswith("hypic-rag serve: error: worker-0 could not start: "), output
