"""Encoding workers: `precompute --workers 2` on the bundled model (every fourth document of its corpus: the
entries do not depend on how many) finishes and writes the same bytes as `--workers 1`, under OMP_NUM_THREADS=1 and =2 (real processes); an index built at one thread count is
used at another; a worker that cannot start stops the encode with one error instead of being restarted forever."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.demo.default_model import default_model_path, example_corpus_path
from hypic_rag.testing import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 300


def environment(threads: int) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")


def cache_contents(index: Path) -> dict[bytes, bytes]:
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        return {key: bytes(store.get(key, touch=False)) for key in store.keys()}


@pytest.mark.slow
@pytest.mark.skipif(not (default_model_path() / "config.json").is_file(), reason="bundled model missing")
def test_two_workers_write_the_same_entries_as_one_at_any_thread_count(tmp_path: Path) -> None:
    corpus = tmp_path / "documents"
    corpus.mkdir()
    for document in sorted((example_corpus_path() / "documents").iterdir())[::4]:
        shutil.copy(document, corpus / document.name)
    runs = {(workers, threads): tmp_path / f"index-w{workers}-t{threads}" for workers in (1, 2) for threads in (1, 2)}
    processes = {
        run: subprocess.Popen(
            [sys.executable, "-m", "hypic_rag", "precompute", str(corpus), "--index", str(index), "--workers",
             str(run[0]), "--device", "cpu", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(run[1]),
        )
        for run, index in runs.items()
    }
    asked: subprocess.Popen[str] | None = None
    try:
        outputs = {(1, 2): processes[(1, 2)].communicate(timeout=RUN_TIMEOUT_S)}
        # an index built with 2 threads, asked with 1 (was exit 3: another fingerprint), while the others run
        asked = subprocess.Popen(
            [sys.executable, "-m", "hypic_rag", "ask", "--index", str(runs[(1, 2)]), "--device", "cpu",
             "What is the hobby of Gramux Mastem?"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment(1),
        )
        outputs.update({run: process.communicate(timeout=RUN_TIMEOUT_S) for run, process in processes.items()
                        if run != (1, 2)})
        answer, answer_errors = asked.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        for process in [*processes.values(), *([asked] if asked else [])]:
            if process.poll() is None:  # was: two workers never finished (restarted forever)
                process.kill()
                process.wait()
    assert asked.returncode == 0, answer_errors
    assert ", 0 encoded" in answer
    reference = cache_contents(runs[(1, 1)])
    assert len(reference) >= 14  # at least one segment per document
    for run, process in processes.items():
        assert process.returncode == 0, (run, outputs[run][1][-2000:])
        segments = len(reference)
        assert f"encoded: {segments} of {segments} segments" in outputs[run][0], (run, outputs[run][0])

    fingerprints = {run: json.loads((index / "manifest.json").read_text())["model"]["fingerprint"]
                    for run, index in runs.items()}
    assert len(set(fingerprints.values())) == 1, fingerprints  # was 0ae09ca3924c (1 thread) vs 85344772a5f7 (2)
    for run, index in runs.items():
        assert cache_contents(index) == reference, run  # byte-identical entries under the same keys


WORKER_SCRIPT = textwrap.dedent(
    """
    import os
    import signal
    import sys

    from hypic_rag.retrieval.encoding_pool import EncoderSpec, EncodingPoolError, SegmentEncoder, SegmentTask
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model


    def encode(model, model_path: str, fingerprint: str) -> str:
        spec = EncoderSpec(model_path=model_path, device="cpu", dtype="float32", seam_tokens=4, fingerprint=fingerprint)
        tasks = [SegmentTask(tuple(range(3, 3 + length)), 4) for length in (9, 17, 5, 12)]
        try:
            with SegmentEncoder(Engine(model, seam_tokens=4), spec, workers=2) as encoder:
                return str(sorted(position for position, _ in encoder.encode(tasks)))
        except EncodingPoolError as error:
            return f"error: {error}"


    def encode_and_kill_a_worker(model, model_path: str) -> str:
        spec = EncoderSpec(model_path=model_path, device="cpu", dtype="float32", seam_tokens=4,
                           fingerprint=model.fingerprint)
        tasks = [SegmentTask(tuple(range(3, 200)), 4) for _ in range(200)]  # ~40 batches: many still pending at the kill
        try:
            with SegmentEncoder(Engine(model, seam_tokens=4), spec, workers=2) as encoder:
                for count, _ in enumerate(encoder.encode(tasks)):
                    if count == 0:
                        os.kill(next(iter(encoder._pool._processes)), signal.SIGKILL)
                return f"finished {count + 1}"
        except EncodingPoolError as error:
            return f"error: {error}"


    if __name__ == "__main__":
        model = load_model(sys.argv[1], device="cpu")
        print(encode(model, sys.argv[1], model.fingerprint))
        print(encode(model, sys.argv[1], "f" * 64))  # workers load another fingerprint than the parent's
        print(encode_and_kill_a_worker(model, sys.argv[1]))
    """
)


def test_a_worker_that_cannot_start_or_dies_stops_the_encode_with_one_error(tmp_path: Path) -> None:
    model = save_tiny_checkpoint(tmp_path / "model", ["a few words to train a tokenizer on"] * 8)
    script = tmp_path / "encode.py"
    script.write_text(WORKER_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(model)], check=False, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=environment(2))
    assert done.returncode == 0, done.stderr
    healthy, failing, killed = done.stdout.strip().splitlines()
    assert healthy == "[0, 1, 2, 3]"
    # each worker fails to start: the encode stops with one error (was: restarted forever, a traceback per attempt,
    # the encode never finished)
    assert failing.startswith("error: an encoding worker could not start: it loaded ") and "parent has ffffffffffff" in failing
    assert killed == "error: an encoding worker process died (killed or out of memory?); try fewer --workers"
    assert "Traceback" not in done.stderr, done.stderr
