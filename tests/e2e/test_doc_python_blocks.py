"""Every ```python block of README.md and docs/*.md runs as written: this module runs those of docs/cache.md,
docs/retrieval.md and docs/runtime.md (each in its own namespace, in a fresh working directory, on the bundled
default model and the example corpus) and checks what they print; the others are run by the tests named in `RUN_ELSEWHERE`. A block
added, removed or moved to another section without this module or those tests knowing fails here.

The remote tier's block talks to a real S3-compatible server on 127.0.0.1 (moto's, `kits.s3`): the
block's endpoint and bucket are replaced by the live server's and a new bucket of it, nothing else.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from hypic_rag import default_model_path, example_corpus_path
from hypic_rag.demo.default_model import answers_reliably

ROOT = Path(__file__).resolve().parents[2]
CACHE_DOC = "docs/cache.md"
RETRIEVAL_DOC = "docs/retrieval.md"
RUNTIME_DOC = "docs/runtime.md"

RUN_HERE = {
    (CACHE_DOC, "The persistent segment cache"),
    (CACHE_DOC, "Remote tier (shared by hosts)"),
    (RETRIEVAL_DOC, "Retrieval: from a folder of documents to a searchable, pre-encoded index"),
    (RUNTIME_DOC, "The ops registry"),
}
"""(document, the heading its block sits under) of the blocks this module runs."""

RUN_ELSEWHERE = {
    "README.md": ("tests/e2e/test_docs_and_examples.py", 2),
    "docs/llama_index.md": ("tests/integrations/test_llama_index_docs.py", 4),
    "docs/service.md": ("tests/server/test_server_retrieval_stage.py", 1),
    "docs/recompute_policies.md": ("tests/runtime/test_recompute_policy_registry.py", 1),
}
"""Document -> (the test that runs all of its ```python blocks, how many it has)."""

DOC_ENDPOINT = "http://127.0.0.1:9000"
DOC_BUCKET_URL = "s3://hypic-docs/"

needs_model = pytest.mark.skipif(not (default_model_path() / "config.json").is_file(),
                                 reason="the bundled default model is missing")


@dataclass(frozen=True, slots=True)
class PythonBlock:
    document: str  # relative to the repository root
    heading: str  # the nearest heading above the block
    line: int  # of the block's first code line
    code: str


def python_blocks(document: str) -> list[PythonBlock]:
    """The ```python blocks of `document`, in order, each with the heading it sits under (headings inside fenced
    blocks, such as shell comments, are not headings)."""
    blocks: list[PythonBlock] = []
    heading = ""
    fence: str | None = None  # the open fence's info string, None outside a fenced block
    code: list[str] = []
    start = 0
    lines = (ROOT / document).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if fence is None:
            if line.startswith("```"):
                fence, code, start = line[3:].strip(), [], number + 1
            elif re.match(r"#{1,6} ", line):
                heading = line.lstrip("#").strip()
        elif line.rstrip() == "```":
            if fence == "python":
                blocks.append(PythonBlock(document, heading, start, "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    assert fence is None, f"{document}: a fenced block is never closed"
    return blocks


def documents() -> list[str]:
    return ["README.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))]


def block_under(document: str, heading: str) -> PythonBlock:
    """The one ```python block of `document` under `heading`; fails when there is none or more than one."""
    found = [block for block in python_blocks(document) if block.heading == heading]
    assert len(found) == 1, f"{document}: expected one ```python block under '{heading}', found {len(found)}"
    return found[0]


def run_block(block: PythonBlock, workdir: Path, replacements: dict[str, str] | None = None) -> list[str]:
    """Exec `block` (with `replacements` made in its text) in `workdir` in a fresh namespace; its printed lines."""
    code = block.code
    for old, new in (replacements or {}).items():
        assert old in code, f"{block.document}:{block.line}: the block no longer contains {old!r}"
        code = code.replace(old, new)
    printed = io.StringIO()
    with contextlib.chdir(workdir), contextlib.redirect_stdout(printed):
        exec(compile(code, f"{block.document}:{block.line}", "exec"), {"__name__": "__doc_block__"})  # noqa: S102
    return printed.getvalue().splitlines()


def test_every_python_block_of_the_docs_is_run_by_a_test() -> None:
    seen_here = set()
    for document in documents():
        blocks = python_blocks(document)
        if document in RUN_ELSEWHERE:
            test_file, count = RUN_ELSEWHERE[document]
            assert len(blocks) == count, (f"{document} has {len(blocks)} ```python blocks, {test_file} runs {count}: "
                                          "run the new block there (or here) and update RUN_ELSEWHERE")
            assert Path(document).name in (ROOT / test_file).read_text(encoding="utf-8"), test_file
            continue
        for block in blocks:
            where = (block.document, block.heading)
            assert where in RUN_HERE, (f"{document}:{block.line}: a ```python block under '{block.heading}' that no "
                                       "test runs: run it in tests/e2e/test_doc_python_blocks.py")
            assert where not in seen_here, f"{document}: two ```python blocks under '{block.heading}'"
            seen_here.add(where)
    assert seen_here == RUN_HERE, f"blocks this module runs are gone: {sorted(RUN_HERE - seen_here)}"


def test_the_ops_registry_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/runtime.md's registry block prints the gated delta rule's backends in order and, on CPU, the chunked
    form for 40 tokens and the step recurrence for one."""
    monkeypatch.setenv("HYPIC_RAG_KERNELS", "auto")
    printed = run_block(block_under(RUNTIME_DOC, "The ops registry"), tmp_path)
    assert printed == ["['fla_recurrent', 'fla', 'recurrent', 'chunk']", "chunk recurrent"]


def test_the_block_scanner_sees_headings_and_fences() -> None:
    """The scanner itself: a '#' line inside a shell block is no heading, and only python fences are blocks."""
    blocks = python_blocks(RETRIEVAL_DOC)
    assert [block.heading for block in blocks] == [
        "Retrieval: from a folder of documents to a searchable, pre-encoded index"]
    assert blocks[0].code.startswith("from pathlib import Path\n")
    text = (ROOT / RETRIEVAL_DOC).read_text(encoding="utf-8").splitlines()
    assert text[blocks[0].line - 2] == "```python"


@needs_model
def test_the_segment_cache_block(tmp_path: Path) -> None:
    hits_line, prefill_line, entries_line = run_block(block_under(CACHE_DOC, "The persistent segment cache"), tmp_path)
    assert hits_line.startswith("[True, True] [True, True] ")  # the second lookup: both chunks are hits, on disk
    assert int(hits_line.split()[-1]) > 0  # stored bytes
    assert prefill_line == "2 1"  # the engine found both chunks in the cache and encoded the prompt prefix's entry
    assert entries_line == "3"
    assert (tmp_path / "segments").is_dir()


@needs_model
def test_the_retrieval_block(tmp_path: Path) -> None:
    summary_line, *hit_lines = run_block(
        block_under(RETRIEVAL_DOC, "Retrieval: from a folder of documents to a searchable, pre-encoded index"), tmp_path)
    documents_count, chunks, encoded, cache_bytes = map(int, summary_line.split())
    assert documents_count == len(list((example_corpus_path() / "documents").glob("*.md")))
    assert chunks >= documents_count and encoded > chunks and cache_bytes > 0  # every chunk, plus the prompt prefix
    assert len(hit_lines) == 4
    scores = [float(line.split()[0]) for line in hit_lines]
    assert scores == sorted(scores, reverse=True)
    assert hit_lines[0].split()[1] == "s777000000-person-8.md"  # Gramux Mastem's document answers the question
    assert (tmp_path / "index" / "manifest.json").is_file()


@needs_model
def test_the_remote_tier_block(tmp_path: Path) -> None:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from kits.s3 import LocalS3, aws_test_environment

    with aws_test_environment():
        server = LocalS3()
        try:
            bucket = server.new_bucket()
            printed = run_block(block_under(CACHE_DOC, "Remote tier (shared by hosts)"), tmp_path,
                                {DOC_ENDPOINT: server.url, DOC_BUCKET_URL: f"s3://{bucket}/"})
            objects = server.objects(bucket, "segments/")
        finally:
            server.stop()
    summary_line, answer_line, hits_line, skipped_line = printed
    chunks, encoded = map(int, summary_line.split())
    assert chunks == len(list((example_corpus_path() / "documents").glob("*.md"))) and encoded == 0
    if answers_reliably()[0]:  # the bundled model answers this corpus
        assert answer_line.startswith("diving")
    assert hits_line == "[True] [True] 1 True"  # a hit from the bucket; the object is there; queued; flushed
    assert skipped_line == "1"  # the upload of the same bytes was skipped
    assert len(objects) == chunks + 2  # every chunk, the prompt prefix, the block's own chunk
