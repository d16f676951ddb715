"""The README's Python snippets and every file in `examples/` run as written, on the bundled default model and
corpus, and print what they promise; a snippet or example that drifts from the package fails here.

Everything runs in this process (the README's blocks with `exec` in a fresh working directory, each example with
`runpy` as `__main__` and its documented options) so that torch is imported once. One index of the example corpus
is built by the README's first block; the examples that start a server reuse a copy of it (`--workdir`), which
their own `build_index` call then finds up to date. Whether they import only front-door names is
`tests/structure/test_front_door.py`.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import shutil
import sys
from pathlib import Path

import pytest

from hypic_rag import default_model_path, read_questions
from hypic_rag.demo.default_model import answers_reliably
from tests.structure.test_front_door import readme_python_blocks

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.skipif(not (default_model_path() / "config.json").is_file(),
                                reason="the bundled default model is missing")


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Run the README's ```python blocks, each in its own namespace, in a fresh working directory; (that directory,
    each block's printed output)."""
    workdir = tmp_path_factory.mktemp("readme")
    outputs = []
    with contextlib.chdir(workdir):
        for number, block in enumerate(readme_python_blocks(), start=1):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(block, f"README.md python block {number}", "exec"), {"__name__": "__readme__"})  # noqa: S102
            outputs.append(printed.getvalue())
    return workdir, outputs


def run_example(name: str, *argv: str) -> str:
    """Run `examples/<name>` as a script with `argv`; what it printed. Fails unless it exits with 0."""
    path = EXAMPLES / name
    printed = io.StringIO()
    saved = sys.argv
    sys.argv = [str(path), *argv]
    try:
        with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as exited:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    assert exited.value.code == 0, printed.getvalue()
    return printed.getvalue()


def workdir_with_index(readme: Path, destination: Path) -> Path:
    """A `--workdir` holding a copy of the README's index as `index` (the examples write to theirs)."""
    shutil.copytree(readme / "my-index", destination / "index")
    return destination


def test_every_example_is_run_here() -> None:
    ran = {"serve_and_ask.py", "openai_client_completions.py", "llama_index_query_engine.py",
           "llama_index_ingestion.py"}
    assert {path.name for path in EXAMPLES.glob("*.py")} == ran


def test_the_readme_python_snippets_run_as_written(readme_run) -> None:
    workdir, outputs = readme_run
    assert len(outputs) == 2
    assert (workdir / "my-index" / "manifest.json").is_file()
    answer_line, usage_line, *streamed = outputs[0].splitlines()
    assert usage_line.split()[0].isdigit() and usage_line.split()[1].isdigit()
    assert streamed[-1].split()[-1] in ("stop", "length")
    assert outputs[1].strip()
    if answers_reliably()[0]:  # the bundled model answers this corpus (96.6% exact match)
        assert answer_line.startswith("diving ") and "s777000000-person-8" in answer_line


def test_serve_and_ask(readme_run, tmp_path: Path) -> None:
    out = run_example("serve_and_ask.py", "--workdir", str(workdir_with_index(readme_run[0], tmp_path)))
    assert "serving on http://127.0.0.1:" in out and "without the key: 401" in out
    assert out.count("  answer: ") == 3  # two questions from the corpus (one streamed), one about the added document
    assert "job succeeded" in out and "deleted: " in out and "cache: " in out


def test_openai_client_completions(readme_run, tmp_path: Path) -> None:
    out = run_example("openai_client_completions.py", "--workdir", str(workdir_with_index(readme_run[0], tmp_path)),
                      "--api-key", "sk-example-key")  # the server it starts checks it, the client sends it
    requests = [line for line in out.splitlines() if line.startswith("request ")]
    assert len(requests) == 3
    assert all(" 0 encoded;" in line for line in requests[1:])  # shuffled documents: every segment from the cache


@pytest.fixture
def llama_settings():
    """The examples set LlamaIndex's global `Settings`; put them back afterwards."""
    settings = pytest.importorskip("llama_index.core").Settings
    saved = dict(vars(settings))
    yield
    vars(settings).update(saved)


def test_llama_index_query_engine(llama_settings) -> None:
    out = run_example("llama_index_query_engine.py", "--questions", "1")
    assert out.startswith(f"Q: {read_questions()[0].text}\n") and "  answer: " in out


def test_llama_index_ingestion(llama_settings, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = run_example("llama_index_ingestion.py", "--cache-dir", str(cache))
    assert first.startswith("ingested ") and first.count("Q: ") == 3
    assert os.listdir(cache)
