"""Bad arguments to every command, given the way a new user would give them: the CLI's `main` in this process (the
checks without root's bypass of file modes in one real process that drops it), a real tiny model, index (SQLite, FAISS) and LMDB segment cache. Each gets exactly one line
on stderr, `hypic-rag <command>: error: ...`, and the documented exit code; arguments are checked before anything
is created, and `--top-k` is capped at the chunks the index holds."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import stat
import subprocess
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from hypic_rag.retrieval.corpus_index import CorpusIndex
from hypic_rag.retrieval.manifest import IndexManifest
from kits.corpora import SMALL_CORPUS, write_corpus
from hypic_rag.cli.in_process import run_cli_here, run_cli_in_one_child

TIMEOUT_S = 300


def _drop_dac_override() -> None:
    """In the child, before exec: drop root's permission-bypass capabilities so modes apply as to any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def hypic(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`hypic-rag ARGV` from directory CWD: the CLI's `main` in this process (the real `python -m hypic_rag` entry
    point runs in tests/cli/test_cli_errors.py and in as_user below)."""
    return run_cli_here(*argv, cwd=cwd)


def as_user(*commands: Sequence[str], cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    """Each of COMMANDS (`hypic-rag` argv) from directory CWD without root's bypass of file modes: one real process,
    its permission-bypass capabilities dropped before exec, that runs the CLI's `main` on each in turn."""
    preexec: Callable[[], None] | None = _drop_dac_override if os.geteuid() == 0 else None
    child, done = run_cli_in_one_child(*commands, cwd=cwd, timeout=TIMEOUT_S, preexec_fn=preexec)
    assert child.returncode == 0, child.stderr
    return done


def assert_one_line(result: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """Exit `code`, exactly one stderr line `hypic-rag <command>...: error: ...` holding every needle."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert re.match(r"hypic-rag [a-z ]+: error: ", lines[0]), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def listing(directory: Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, object]:
    """A corpus, a tiny model, a plain file; `precompute --cache <the file>` (refused), then the same with a good
    --cache (the module's index, whose segment cache lives outside it)."""
    root = tmp_path_factory.mktemp("cli_arguments")
    model = tiny_model
    corpus = write_corpus(root / "corpus", SMALL_CORPUS)
    a_file = root / "a_file.txt"
    a_file.write_text("not a directory\n")
    (root / "not_an_index").mkdir()
    (root / "not_an_index" / "notes.txt").write_text("a directory of other things\n")
    index, cache = root / "index", root / "cache"
    common = ("--model", str(model), "--chunk-tokens", "48", "--no-progress")
    refused = hypic("precompute", "corpus", "--index", "index", "--cache", "a_file.txt", *common, cwd=root)
    created_after_refusal = sorted(path.name for path in root.iterdir())
    built = hypic("precompute", "corpus", "--index", "index", "--cache", "cache", *common, cwd=root)
    return {"root": root, "model": model, "corpus": corpus, "a_file": a_file, "index": index, "cache": cache,
            "refused": refused, "created_after_refusal": created_after_refusal, "built": built, "common": common}


def test_a_file_as_cache_creates_nothing_and_a_good_cache_then_works(work: dict) -> None:
    assert_one_line(work["refused"], 2, "segment cache directory unusable", "a_file.txt is a file, not a directory")
    assert work["created_after_refusal"] == ["a_file.txt", "corpus", "not_an_index"]  # no index, no cache
    assert work["built"].returncode == 0, work["built"].stderr
    manifest = IndexManifest.load(work["index"])
    assert manifest.cache_path(work["index"]) == work["cache"].resolve()
    assert (work["cache"] / "data.mdb").is_file() and not (work["index"] / "segment_cache").exists()
    assert work["a_file"].read_text() == "not a directory\n"
    # the index records its cache: another --cache is refused (exit 3) before anything is created
    root, common = work["root"], work["common"]
    assert_one_line(hypic("precompute", "corpus", "--index", "index", "--cache", "elsewhere", *common, cwd=root),
                    3, "keeps its segment cache in", "omit --cache")


PATH_CASES = [
    (("precompute", "corpus", "--index", "a_file.txt/sub"), 2, ("cannot create", "a_file.txt is a file")),
    (("precompute", "corpus", "--index", "not_an_index"), 2, ("is not empty and holds no index", "notes.txt")),
    (("precompute", "corpus", "--index", "corpus"), 2, ("is not empty and holds no index",)),
    (("precompute", "corpus", "--index", "new", "--cache", "a_file.txt/sub"), 2, ("segment cache directory",)),
    (("ask", "--index", "a_file.txt/sub", "Who grows lavender?"), 2, ("holds no index",)),
    (("ask", "--index", "a_file.txt", "Who grows lavender?"), 2, ("is a file, not an index directory",)),
    (("serve", "--index", "a_file.txt/sub", "--port", "0"), 2, ("no index at",)),
    (("cache", "stats", "--cache", "a_file.txt/sub"), 2, ("no cache directory",)),
    (("demo", "--index", "a_file.txt/sub"), 2, ("cannot create", "a_file.txt is a file")),
    (("bench", "--profile", "test", "--output", "a_file.txt/sub"), 2, ("cannot create", "a_file.txt is a file")),
]


@pytest.mark.parametrize("argv, code, needles", PATH_CASES, ids=[" ".join(argv) for argv, _, _ in PATH_CASES])
def test_paths_that_cannot_hold_an_index_get_one_line(work: dict, argv: Sequence[str], code: int,
                                                       needles: Sequence[str]) -> None:
    root = work["root"]
    before = listing(root)
    if argv[0] == "precompute":
        argv = (*argv, *work["common"])
    assert_one_line(hypic(*argv, cwd=root), code, *needles)
    assert listing(root) == before  # nothing created, nothing written into the corpus or the other directory


def test_unwritable_places_get_one_line_and_nothing_is_created(work: dict, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    hidden_corpus = write_corpus(tmp_path / "hidden_corpus", SMALL_CORPUS)  # cannot be listed
    read_only_index = tmp_path / "read_only_index"
    shutil.copytree(work["index"], read_only_index, ignore=shutil.ignore_patterns("*-wal", "*-shm", "index.lock"))
    directories = [read_only_index, locked, hidden_corpus]
    for directory in directories:
        directory.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    hidden_corpus.chmod(0)
    root, common = work["root"], work["common"]
    try:
        try:
            new, cache, ask, serve, hidden = as_user(
                ("precompute", "corpus", "--index", str(locked / "index"), *common),
                ("precompute", "corpus", "--index", str(tmp_path / "index"), "--cache", str(locked / "cache"), *common),
                ("ask", "--index", str(read_only_index), "Who grows lavender?"),
                ("serve", "--index", str(read_only_index), "--port", "0"),
                ("precompute", str(hidden_corpus), "--index", str(tmp_path / "hidden_index"), *common), cwd=root)
        except subprocess.SubprocessError as error:
            pytest.skip(f"cannot drop root's permission bypass here: {error}")
        assert str(locked) in assert_one_line(new, 2, "index directory unusable", "is not writable")
        assert_one_line(cache, 2, "segment cache directory unusable", "is not writable")
        assert list(locked.iterdir()) == []
        assert_one_line(ask, 2, "is not writable")
        assert_one_line(serve, 2, "is not writable")
        assert_one_line(hidden, 2, "holds no", "./: unreadable directory")  # named, not silent
        assert not (tmp_path / "index").exists() and not (tmp_path / "hidden_index").exists()
    finally:
        for directory in directories:
            directory.chmod(stat.S_IRWXU)


def test_top_k_is_capped_at_the_index_size(work: dict) -> None:
    """A huge k allocates nothing more than the whole index (it used to pad FAISS results to k: 12 GiB for 1e9)."""
    chunks = IndexManifest.load(work["index"]).counts["chunks"]
    assert chunks >= 6
    with CorpusIndex.open(work["index"]) as index:
        index.embedder.load()
        index.search("warm up", k=2)
        for hop_slots in (0, 2):
            tracemalloc.start()
            try:
                hits = index.search("Who grows lavender and sells honey?", k=10**9, hop_slots=hop_slots)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert len(hits) == chunks and len({hit.chunk.vector_id for hit in hits}) == chunks
            assert hits[0].chunk.doc_id == "lavender.md" and peak < 32 << 20, peak
        query = index.embedder.embed_query("volcano")[None, :]
        scores, ids = index.vectors.search(query, 10**9)
        assert scores.shape == ids.shape == (1, chunks) and sorted(ids[0].tolist()) == sorted(
            index.docstore.live_vector_ids().tolist())
    answered = hypic("ask", "--index", "index", "--top-k", "256", "--max-new-tokens", "2",  # the most --top-k takes
                     "Who grows lavender and sells honey?", cwd=work["root"])
    assert answered.returncode == 0, answered.stderr
    sources = re.findall(r"^  \[(\d+)\] (\S+)", answered.stdout, flags=re.MULTILINE)
    assert len(sources) == chunks and sources[0][1] == "lavender.md"


ODD_ARGUMENTS = [
    (("ask", "--index", "index", "--top-k", "0", "q"), "argument --top-k: must be an integer in 1..256, got 0"),
    (("ask", "--index", "index", "--top-k", "-5", "q"), "argument --top-k: must be an integer in 1..256, got -5"),
    (("ask", "--index", "index", "--top-k", "many", "q"), "argument --top-k: must be an integer in 1..256, got 'many'"),
    (("ask", "--index", "index", "--top-k", "1000000000", "q"), "argument --top-k: must be an integer in 1..256"),
    (("ask", "--index", "index", "--max-new-tokens", "0", "q"), "argument --max-new-tokens"),
    (("ask", "--index", "index", "--device", "bogus", "q"), "argument --device: not a device"),
    (("ask", "--index", "index", "--model", "no_model", "q"), "no_model"),
    (("precompute", "not_an_index/notes.txt/x", "--index", "i"), "does not exist"),
    (("precompute", "corpus", "--index", "i", "--chunk-tokens", "0"), "argument --chunk-tokens"),
    (("precompute", "corpus", "--index", "i", "--chunk-tokens", "4"), "chunk_tokens must be"),
    (("precompute", "corpus", "--index", "i", "--workers", "0"), "argument --workers: must be an integer in 1.."),
    (("precompute", "corpus", "--index", "i", "--workers", "100000"), "argument --workers: must be an integer in 1.."),
    (("precompute", "corpus", "--index", "i", "--seam-tokens", "-1"), "argument --seam-tokens"),
    (("precompute", "corpus", "--index", "i", "--device", "cuda:99"), "argument --device"),
    (("serve", "--index", "index", "--request-timeout", "nan"), "argument --request-timeout"),
    (("serve", "--index", "index", "--request-timeout", "inf"), "argument --request-timeout"),
    (("serve", "--index", "index", "--shutdown-grace", "0"), "argument --shutdown-grace"),
    (("serve", "--index", "index", "--port", "-1"), "argument --port"),
    (("serve", "--index", "index", "--queue-size", "0"), "argument --queue-size"),
    (("serve", "--index", "index", "--prefill-wait", "-0.1"), "argument --prefill-wait"),
    (("serve", "--index", "index", "--prefill-wait", "11"), "argument --prefill-wait"),
    (("cache", "gc", "--cache", "cache", "--budget", "0.1"), "argument --budget: not a positive size"),
    (("cache", "gc", "--cache", "cache", "--budget", "99999999T"), "argument --budget: not a positive size"),
    (("cache", "stats"), "--cache"),
    (("cache",), "required: ACTION"),
    (("demo", "--questions", "0"), "argument --questions"),
    (("demo", "--top-k", "-1"), "argument --top-k"),
    (("bench", "--profile", "huge"), "argument --profile"),
]


@pytest.mark.parametrize("argv, needle", ODD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in ODD_ARGUMENTS])
def test_odd_arguments_get_one_line_and_exit_2(work: dict, argv: Sequence[str], needle: str) -> None:
    root = work["root"]
    before = listing(root)
    line = assert_one_line(hypic(*argv, cwd=root), 2, needle)
    assert line.startswith(f"hypic-rag {argv[0]}")
    assert listing(root) == before
    if argv[:2] == ("cache", "gc"):
        assert json.loads(hypic("cache", "stats", "--cache", "cache", "--json", cwd=root).stdout)["entries"] > 0


def test_an_unreadable_index_file_gets_one_line(work: dict, tmp_path: Path) -> None:
    garbage_docstore = shutil.copytree(work["index"], tmp_path / "garbage_docstore")
    for path in garbage_docstore.glob("docstore.sqlite*"):
        path.unlink()
    (garbage_docstore / "docstore.sqlite").write_bytes(os.urandom(8192))
    assert_one_line(hypic("ask", "--index", str(garbage_docstore), "Who grows lavender?", cwd=tmp_path),
                    1, "cannot read", "docstore.sqlite")
    garbage_manifest = shutil.copytree(work["index"], tmp_path / "garbage_manifest")
    (garbage_manifest / "manifest.json").write_text("{not json")
    assert_one_line(hypic("serve", "--index", str(garbage_manifest), "--port", "0", cwd=tmp_path),
                    1, "cannot read", "manifest.json")
