"""Corpus loading from real files: directories, single files, .jsonl records, and every kind of bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hypic_rag.retrieval.errors import CorpusNotFoundError, EmptyCorpusError
from hypic_rag.retrieval.loading import Document, load_corpus


def write_corpus(root: Path) -> Path:
    (root / "notes" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("The lighthouse of Kerran is red.\n", encoding="utf-8")
    (root / "notes" / "b.md").write_text("# Bakery\n\nRye bread on Tuesdays.\n", encoding="utf-8")
    (root / "notes" / "deep" / "c.txt").write_text("\ufeffMount Aster is 4120 metres tall.", encoding="utf-8")
    records = [
        {"id": "river", "text": "The river Lune flows north.", "topic": "geography", "year": 1901},
        {"text": "A record without an id."},
        {"id": 7, "text": "An integer id."},
    ]
    (root / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    (root / "script.py").write_text("print('not a document')\n", encoding="utf-8")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "secret.txt").write_text("hidden text", encoding="utf-8")
    return root


def test_directory_is_loaded_recursively_with_stable_ids(tmp_path: Path) -> None:
    corpus = load_corpus(write_corpus(tmp_path))
    ids = [document.doc_id for document in corpus.documents]
    assert ids == ["a.txt", "notes/b.md", "notes/deep/c.txt", "river", "records.jsonl:2", "7"]
    by_id = {document.doc_id: document for document in corpus.documents}
    assert by_id["notes/deep/c.txt"].text == "Mount Aster is 4120 metres tall."  # BOM stripped
    assert by_id["river"].metadata == {"topic": "geography", "year": 1901}
    assert by_id["river"].source == "records.jsonl:1"
    assert corpus.skipped == []
    assert corpus.ignored_files == 1  # script.py; the hidden folder is not even counted
    assert corpus.root == tmp_path.resolve()


def test_single_file_is_a_corpus(tmp_path: Path) -> None:
    path = tmp_path / "only.md"
    path.write_text("One document.", encoding="utf-8")
    corpus = load_corpus(path)
    assert [(d.doc_id, d.text) for d in corpus.documents] == [("only.md", "One document.")]


def test_binary_unreadable_and_non_utf8_files_are_skipped_by_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "good.txt").write_text("Readable text.", encoding="utf-8")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "latin1.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "missing-target.txt")
    (tmp_path / "blank.txt").write_text("   \n\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="hypic_rag.retrieval.loading"):
        corpus = load_corpus(tmp_path)
    assert [d.doc_id for d in corpus.documents] == ["good.txt"]
    reasons = {skip.location: skip.reason for skip in corpus.skipped}
    assert reasons["image.txt"] == "binary file"
    assert reasons["latin1.md"].startswith("not UTF-8 text")
    assert reasons["dangling.txt"].startswith("unreadable")
    assert reasons["blank.txt"] == "no text"
    for name in ("image.txt", "latin1.md", "dangling.txt"):
        assert any(name in record.getMessage() for record in caplog.records), name


def test_malformed_jsonl_lines_are_named_skips(tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "ok", "text": "Fine."}),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"id": "no-text", "title": "missing text"}),
        json.dumps({"id": {"nested": 1}, "text": "bad id"}),
        json.dumps({"id": "ok", "text": "Duplicate id."}),
    ]
    (tmp_path / "data.jsonl").write_text("\n".join(lines), encoding="utf-8")
    corpus = load_corpus(tmp_path)
    assert [d.doc_id for d in corpus.documents] == ["ok"]
    skipped = [str(skip) for skip in corpus.skipped]
    assert skipped[0].startswith("data.jsonl:2: malformed JSON")
    assert skipped[1] == "data.jsonl:3: not a JSON object"
    assert skipped[2] == "data.jsonl:4: no non-empty 'text' string field"
    assert skipped[3] == "data.jsonl:5: 'id' must be a string or an integer"
    assert skipped[4] == "data.jsonl:6: duplicate document id 'ok'"


def test_missing_path_and_empty_corpus_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmptyCorpusError, match="holds no .txt, .md, .jsonl, .pdf, .html or .docx document"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.txt").write_bytes(b"\x00\x01\x02")
    with pytest.raises(EmptyCorpusError, match="1 inputs skipped"):
        load_corpus(tmp_path / "binary")


def test_content_digest_tracks_text_and_metadata() -> None:
    base = Document("d", "text", "d", {"k": 1})
    assert base.content_sha256 == Document("d", "text", "elsewhere", {"k": 1}).content_sha256
    assert base.content_sha256 != Document("d", "text!", "d", {"k": 1}).content_sha256
    assert base.content_sha256 != Document("d", "text", "d", {"k": 2}).content_sha256
    with pytest.raises(ValueError):
        Document("", "text", "d")
