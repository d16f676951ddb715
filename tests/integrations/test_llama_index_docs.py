"""The snippets of `docs/llama_index.md` run as written, one after the other, on the bundled default model, in a
folder whose `docs/` holds part of the bundled example corpus with one document as an HTML page (read through
`file_extractors()`); LlamaIndex's untouched `as_query_engine()` gives the right answer there."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Settings  # noqa: E402

from hypic_rag.demo.default_model import answers_reliably, example_corpus_path  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "llama_index.md"
HTML_DOCUMENT = "s777000000-person-8"  # Gramux Mastem, whose hobby the snippets ask about
ASKED_DOCUMENT = "s777000000-person-11"  # Zutaifu Kotu, whose city the reuse snippet asks about
DOCUMENT_STRIDE = 4  # every 4th document of the example corpus besides those two: a quick ingestion
READY, WHY_NOT = answers_reliably()


def python_snippets(path: Path) -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of a Markdown file, in order."""
    text = path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, match.start()) + 2, match.group(1))
            for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)]


def write_docs_folder(folder: Path) -> None:
    """Every `DOCUMENT_STRIDE`th document of the example corpus and the asked ones, `HTML_DOCUMENT` as an HTML page
    with a script and a style sheet."""
    folder.mkdir()
    for document in sorted((example_corpus_path() / "documents").glob("*.md"))[::DOCUMENT_STRIDE]:
        if document.stem != HTML_DOCUMENT:
            shutil.copy(document, folder / document.name)
    shutil.copy(example_corpus_path() / "documents" / f"{ASKED_DOCUMENT}.md", folder / f"{ASKED_DOCUMENT}.md")
    text = (example_corpus_path() / "documents" / f"{HTML_DOCUMENT}.md").read_text(encoding="utf-8")
    (folder / f"{HTML_DOCUMENT}.html").write_text(
        "<!doctype html><html><head><title>Gramux Mastem</title><style>p { color: red }</style>"
        "<script>var SCRIPTMARKER = 1;</script></head>"
        f"<body><p>{html.escape(text)}</p></body></html>", encoding="utf-8")


def test_the_llama_index_page_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    snippets = python_snippets(DOC)
    assert len(snippets) >= 4
    write_docs_folder(tmp_path / "docs")
    monkeypatch.chdir(tmp_path)
    previous = (Settings._llm, Settings._embed_model, Settings._callback_manager)
    namespace: dict[str, object] = {"__name__": "llama_index_docs"}
    try:
        for line, code in snippets:
            exec(compile(code, f"{DOC}:{line}", "exec"), namespace)  # noqa: S102 - the page's own code
    finally:
        Settings._llm, Settings._embed_model, Settings._callback_manager = previous
        llm = namespace.get("llm")
        if llm is not None:
            llm.runtime.close()  # type: ignore[attr-defined]
    documents = namespace["documents"]
    html_pages = [d for d in documents if d.metadata["file_name"] == f"{HTML_DOCUMENT}.html"]  # type: ignore[attr-defined]
    assert html_pages and all("SCRIPTMARKER" not in d.text and "<p>" not in d.text for d in html_pages)
    assert all(d.metadata["file_path"].endswith(d.metadata["file_name"]) for d in documents)  # type: ignore[attr-defined]
    printed = capsys.readouterr().out.split()
    assert printed[-1] == f"{HTML_DOCUMENT}.html"  # the default engine's best source: the HTML page
    if not READY:
        pytest.skip(f"answers not checked: {WHY_NOT}")
    assert printed[:-1] == ["diving"]  # LlamaIndex's default template (ending in "Answer: ") answers
    assert namespace["response"].response == "diving"  # type: ignore[attr-defined]
    assert "diving" in str(namespace["reply"])
