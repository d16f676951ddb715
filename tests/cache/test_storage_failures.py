"""Damaged and full storage as a user meets it: one line and an exit code, never a signal death or a traceback,
and the data stored before intact.

- A `data.mdb` cut short (LMDB would touch pages past its end: SIGBUS) is found from its meta pages before it is
  mapped: `cache stats | verify | gc` say so in one line (exit 1), `cache clear` starts an empty cache, `ask`
  and `serve` answer with the cache disabled and one warning, `precompute` refuses in one line (exit 1).
- `cache clear | gc` refuse a read-only directory (exit 2) and delete nothing, also when run as root.
- A garbage `docstore.sqlite`: one line, exit 1, for `ask`, `precompute` and `serve`.
- Disk full (a real 2 MiB tmpfs, mounted here when running as root) while writing the cache or the index: one
  line, exit 1; what was stored before is intact and readable.
- Output cut short by its reader (`cache stats --json | head`): a quiet exit (141).

Commands run on real files in child processes (`python -m hypic_rag`, or several commands through the CLI's `main`
in one child: a signal death must not take the test runner with it), or in this process where the store is
intact.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from hypic_rag.cache.errors import CacheDamagedError, CacheWriteError
from hypic_rag.cache.keys import CacheNamespace
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cache.maintenance import verify_store
from hypic_rag.cache.segment_cache import SegmentCache
from hypic_rag.cache.synthetic import TINY_SHAPE, synthetic_entry
from hypic_rag.cli.main import main
from hypic_rag.retrieval.chunking import ChunkerConfig
from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
from hypic_rag.retrieval.errors import IndexWriteError
from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute
from hypic_rag.testing import free_port
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, write_corpus
from hypic_rag.cli.in_process import run_cli_here, run_cli_in_one_child
from storage_support import fetch_or_make_many

REPO_ROOT = Path(__file__).resolve().parents[2]
SIGBUS_EXITS = (-signal.SIGBUS, 128 + signal.SIGBUS)
CHUNK_TOKENS = 96
NS = CacheNamespace(model_fingerprint="m", tokenizer_fingerprint="t", seam_tokens=8)
TWO_DOCUMENTS = dict(list(SMALL_CORPUS.items())[:2])
QUESTION = SMALL_CORPUS_QUESTIONS["glassblowing.md"]


# ------------------------------------------------------------------------------------------------ helpers
def hypic_rag(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`python -m hypic_rag ARGV` in a child process running this checkout."""
    return subprocess.run(
        [sys.executable, "-m", "hypic_rag", *argv], capture_output=True, text=True, timeout=timeout, env=child_env(),
    )


def in_one_child(*commands: Sequence[str]) -> list[subprocess.CompletedProcess[str]]:
    """`hypic-rag ARGV` for each of COMMANDS in turn, all in one child process running this checkout; it must not
    die of a signal (SIGBUS from a cut-short LMDB file)."""
    child, done = run_cli_in_one_child(*commands, timeout=240)
    assert child.returncode not in SIGBUS_EXITS, "killed by SIGBUS"
    assert child.returncode == 0, child.stderr
    return done


def child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


def assert_one_line(completed: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """The command exited with `code` (not killed by SIGBUS) after printing one stderr line holding `fragments`."""
    assert completed.returncode not in SIGBUS_EXITS, "killed by SIGBUS"
    assert "Traceback" not in completed.stderr, completed.stderr
    lines = completed.stderr.strip().splitlines()
    assert completed.returncode == code and len(lines) == 1, (completed.returncode, completed.stderr)
    assert lines[0].startswith("hypic-rag ") and ": error: " in lines[0], lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def populate(directory: Path, chunks: int = 5) -> list[bytes]:
    """A cache of `chunks` synthetic entries; their keys."""
    ids = [list(range(start, start + 20)) for start in range(0, 20 * chunks, 20)]
    with SegmentCache.open(directory, disk_budget_bytes=64 << 20) as cache:
        fetch_or_make_many(cache, NS, ids, lambda missing: [synthetic_entry(TINY_SHAPE, i) for i in missing])
    with LmdbSegmentStore.open(directory, readonly=True) as store:
        return sorted(store.keys())


def cut(data_file: Path, size: int) -> None:
    os.truncate(data_file, size)


def options(corpus: Path, index: Path, model: Path, cache: Path | None = None) -> PrecomputeConfig:
    return PrecomputeConfig(corpus=corpus, index_dir=index, model_path=model, chunk_tokens=CHUNK_TOKENS,
                             cache_dir=cache, device="cpu", show_progress=False)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Path:
    return tiny_model


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(two documents, all six) of the small corpus."""
    base = tmp_path_factory.mktemp("corpora")
    return write_corpus(base / "two", TWO_DOCUMENTS), write_corpus(base / "six", SMALL_CORPUS)


@pytest.fixture(scope="module")
def built_index(tmp_path_factory: pytest.TempPathFactory, model: Path, corpora: tuple[Path, Path]) -> Path:
    """An index of the whole small corpus with its cache in `<index>/segment_cache` (tests copy it)."""
    index = tmp_path_factory.mktemp("built") / "index"
    precompute(options(corpora[1], index, model))
    return index


@pytest.fixture
def index_copy(built_index: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(built_index, tmp_path / "index"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs mounted for the test (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 2 MiB tmpfs to fill it needs root")
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(disk: Path, leave_bytes: int = 0) -> Path:
    """Take all but `leave_bytes` of the free space on `disk` with one file; returns it (delete it to free)."""
    filler = disk / "filler"
    size = shutil.disk_usage(disk).free - leave_bytes
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(descriptor, 0, size)
    finally:
        os.close(descriptor)
    assert shutil.disk_usage(disk).free <= leave_bytes
    return filler


# ------------------------------------------------------------------------------------- a truncated data.mdb
def test_every_cut_of_data_mdb_is_one_line_not_sigbus(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    populate(directory)
    data_file = directory / "data.mdb"
    whole = data_file.read_bytes()
    page = 4096
    aligned = [len(whole) // 2 // page * page, len(whole) * 3 // 4 // page * page]  # found by the B-tree walk
    cut_copies = []
    for size in dict.fromkeys((100, page, 2 * page + 1, len(whole) // 2, len(whole) - 1, *aligned)):  # distinct
        copy = Path(shutil.copytree(directory, tmp_path / f"cut_{size}"))
        (copy / "data.mdb").write_bytes(whole[:size])
        with pytest.raises(CacheDamagedError):
            LmdbSegmentStore.open(copy, readonly=True)
        cut_copies.append(copy)
    # one child process runs every command (a SIGBUS kills it, not the test runner)
    *cut_stats, whole_stats = in_one_child(*(("cache", "stats", "--cache", str(copy)) for copy in cut_copies),
                                           ("cache", "stats", "--cache", str(directory), "--json"))
    for copy, stats in zip(cut_copies, cut_stats):
        line = assert_one_line(stats, 1, str(copy / "data.mdb"))
        assert "is truncated" in line and "cache clear" in line
    assert json.loads(whole_stats.stdout)["entries"] == 5


def test_cache_commands_on_a_truncated_store_and_clear_recovers(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    populate(directory)
    data_file = directory / "data.mdb"
    cut(data_file, data_file.stat().st_size // 2)
    # while another process has a store open, clear refuses and removes nothing
    size_before = data_file.stat().st_size
    held = tmp_path / "held"
    populate(held)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from hypic_rag.cache.lmdb_store import LmdbSegmentStore as S; "
         "s = S.open(sys.argv[1], readonly=True, create=False); print('open', flush=True); sys.stdin.read()",
         str(held)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        cut(held / "data.mdb", (held / "data.mdb").stat().st_size // 2)
        held_size = (held / "data.mdb").stat().st_size
        *actions, clear_held = in_one_child(
            *(("cache", *action, "--cache", str(directory)) for action in (["stats"], ["stats", "--json"],
                                                                             ["verify"], ["gc"])),
            ("cache", "clear", "--cache", str(held)))
        for completed in actions:
            assert_one_line(completed, 1, f"{data_file} is truncated")
            assert completed.stdout == ""
        assert_one_line(clear_held, 2, "open in another process")
        assert (held / "data.mdb").stat().st_size == held_size
    finally:
        holder.communicate("")
    assert data_file.stat().st_size == size_before
    cleared, stats = in_one_child(("cache", "clear", "--cache", str(directory)),
                                  ("cache", "stats", "--cache", str(directory), "--json"))
    assert cleared.returncode == 0 and cleared.stderr == "", cleared.stderr
    assert "removed the damaged store" in cleared.stdout
    assert json.loads(stats.stdout)["entries"] == 0
    with LmdbSegmentStore.open(directory) as store:  # a working cache again
        assert verify_store(store).checked == 0 and store.counters().entries == 0


def test_ask_answers_with_the_cache_disabled_and_precompute_refuses(index_copy: Path, model: Path,
                                                                    corpora: tuple[Path, Path]) -> None:
    data_file = index_copy / "segment_cache" / "data.mdb"
    cut_size = data_file.stat().st_size // 2
    cut(data_file, cut_size)
    asked, refused = in_one_child(("ask", QUESTION, "--index", str(index_copy), "--max-new-tokens", "4"),
                                  ("precompute", str(corpora[1]), "--index", str(index_copy), "--model", str(model),
                                   "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress"))
    assert asked.returncode == 0, asked.stderr
    assert "Answer:" in asked.stdout and "glassblowing.md" in asked.stdout
    warnings = asked.stderr.strip().splitlines()
    assert len(warnings) == 1 and "segment cache disabled" in warnings[0] and str(data_file) in warnings[0], warnings
    assert_one_line(refused, 1, f"{data_file} is truncated", "hypic-rag cache clear --cache")
    assert data_file.stat().st_size == cut_size  # neither wrote to it


def test_serve_starts_with_the_cache_disabled(index_copy: Path) -> None:
    data_file = index_copy / "segment_cache" / "data.mdb"
    cut(data_file, data_file.stat().st_size // 2)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index_copy), "--port", str(port),
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert server.poll() is None, server.communicate()
        processes = len(httpx.get(f"{url}/healthz", timeout=30).json().get("replicas", [None]))  # the default's workers
        stats = httpx.get(f"{url}/v1/cache/stats", timeout=30).json()["cache"]
        assert "is truncated" in stats["disabled"] and stats["entries"] == 0
        answered = httpx.post(f"{url}/v1/ask", json={"question": QUESTION, "max_new_tokens": 4}, timeout=120)
        assert answered.status_code == 200, answered.text
        assert answered.json()["sources"][0]["doc_id"] == "glassblowing.md"
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=120)
    assert server.returncode == 0 and "Traceback" not in stderr, stderr
    assert sum("segment cache disabled" in line for line in stderr.splitlines()) == processes, stderr  # one each


# ------------------------------------------------------------------------------------------ read-only, pipes
def test_clear_and_gc_refuse_a_read_only_directory_and_delete_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    keys = populate(directory)
    directory.chmod(0o555)  # the files stay writable: only the directory is read-only (root ignores it otherwise)
    try:
        for action in ("clear", "gc"):  # an intact store: no signal to fear, the CLI's `main` in this process
            assert_one_line(run_cli_here("cache", action, "--cache", str(directory)), 2,
                            f"cannot write to {directory}", "read-only")
    finally:
        directory.chmod(0o755)
    (directory / "data.mdb").chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    assert_one_line(run_cli_here("cache", "clear", "--cache", str(directory)), 2, "data.mdb: it is read-only")
    (directory / "data.mdb").chmod(0o644)
    with LmdbSegmentStore.open(directory, readonly=True) as store:
        assert sorted(store.keys()) == keys and not verify_store(store).problems


def test_output_cut_short_by_its_reader_is_a_quiet_exit(tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    populate(directory)
    child = subprocess.Popen([sys.executable, "-m", "hypic_rag", "cache", "stats", "--json", "--cache", str(directory)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env())
    assert child.stdout is not None
    child.stdout.close()  # the reader is gone before the command writes (as `| head` after its lines)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 141 and stderr == b"", stderr.decode()


# --------------------------------------------------------------------------------------- a garbage docstore
def test_a_garbage_docstore_is_one_line_for_ask_precompute_and_serve(index_copy: Path, model: Path,
                                                                     corpora: tuple[Path, Path],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    docstore = index_copy / "docstore.sqlite"
    garbage = b"this is not an SQLite database, " * 1000
    docstore.write_bytes(garbage)
    expected = f"cannot read {docstore}: file is not a database"
    # ask and precompute in this process (no signal can hit it; the model is already imported), serve as a child
    for argv in (["ask", QUESTION, "--index", str(index_copy)],
                 ["precompute", str(corpora[1]), "--index", str(index_copy), "--model", str(model),
                  "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress"]):
        code = main(argv)
        captured = capsys.readouterr()
        assert_one_line(subprocess.CompletedProcess(argv, code, captured.out, captured.err), 1, expected)
    assert_one_line(hypic_rag("serve", "--index", str(index_copy), "--port", str(free_port())), 1, expected)
    assert docstore.read_bytes() == garbage  # untouched


# ------------------------------------------------------------------------------------------------ disk full
def test_disk_full_while_writing_the_cache(small_disk: Path, tmp_path: Path, model: Path,
                                           corpora: tuple[Path, Path]) -> None:
    index, cache = tmp_path / "index", small_disk / "cache"
    precompute(options(corpora[0], index, model, cache))
    with LmdbSegmentStore.open(cache, readonly=True) as store:
        keys_before = sorted(store.keys())
    filler = fill(small_disk, leave_bytes=16 << 10)  # less than one entry
    failed = hypic_rag("precompute", str(corpora[1]), "--index", str(index), "--model", str(model),
                       "--cache", str(cache), "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress")
    assert_one_line(failed, 1, f"cannot write to the cache at {cache}", "free on its file system", "intact")
    with LmdbSegmentStore.open(cache, readonly=True) as store:  # still full: read-only use works
        report = verify_store(store)
        assert sorted(store.keys()) == keys_before and report.checked == len(keys_before) and not report.problems
    filler.unlink()


def test_disk_full_while_writing_the_index(small_disk: Path, tmp_path: Path, model: Path,
                                           corpora: tuple[Path, Path]) -> None:
    index, cache = small_disk / "index", tmp_path / "cache"
    precompute(options(corpora[0], index, model, cache))
    filler = fill(small_disk)
    failed = hypic_rag("precompute", str(corpora[1]), "--index", str(index), "--model", str(model),
                       "--cache", str(cache), "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress")
    assert_one_line(failed, 1, f"{index / 'docstore.sqlite'}", "0 B free on its file system")
    filler.unlink()
    with CorpusIndex.open(index) as opened:
        assert opened.counts().documents == len(TWO_DOCUMENTS)
        assert opened.search(QUESTION, 1)[0].chunk.doc_id == "glassblowing.md"
        manifest = opened.manifest
    # the FAISS file fails to write after the docstore changed: one error, the old file kept, no temporary left
    settings = IndexConfig(model=manifest.model, chunker=ChunkerConfig(chunk_tokens=CHUNK_TOKENS), cache_dir=cache)
    vectors = index / "vectors.faiss"
    vectors_before = vectors.read_bytes()
    from hypic_rag.retrieval.embeddings import SentenceEmbedder

    with CorpusIndex.open_for_update(index, SentenceEmbedder(manifest.embedder_path), settings) as writer:
        writer.docstore.delete_document("astronomy.md")
        filler = fill(small_disk)
        with pytest.raises(IndexWriteError, match="cannot write the index in .*No space left on device"):
            writer.save()
    assert vectors.read_bytes() == vectors_before and not (index / "vectors.faiss.tmp").exists()
    filler.unlink()
    with CorpusIndex.open(index) as opened:  # the FAISS file catches up with the docstore on open
        assert opened.counts().documents == 1 and len(opened.vectors) == 1
        assert opened.search(QUESTION, 1)[0].chunk.doc_id == "glassblowing.md"


def test_a_failed_cache_write_is_a_warning_for_best_effort_users(small_disk: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    directory = small_disk / "cache"
    keys = populate(directory, chunks=2)
    filler = fill(small_disk)
    fresh = [list(range(1000 + start, 1020 + start)) for start in range(0, 60, 20)]
    encode = lambda missing: [synthetic_entry(TINY_SHAPE, ids) for ids in missing]  # noqa: E731
    with SegmentCache.open(directory) as strict, pytest.raises(CacheWriteError, match="cannot write to the cache"):
        fetch_or_make_many(strict, NS, fresh, encode)
    with caplog.at_level(logging.WARNING, logger="hypic_rag.cache"), SegmentCache.open(
        directory, best_effort=True
    ) as lenient:
        entries, hits = fetch_or_make_many(lenient, NS, fresh, encode)  # served (ask, serve), only not kept
    assert len(entries) == 3 and hits == [False] * 3
    assert any("going on without storing" in record.getMessage() for record in caplog.records)
    filler.unlink()
    with LmdbSegmentStore.open(directory, readonly=True) as store:
        assert sorted(store.keys()) == keys and not verify_store(store).problems
