"""PDF, HTML, DOCX and Markdown through their parsers: real files written here (pypdf's writer, python-docx),
loaded, precomputed with the real CLI on a tiny model, asked with the real CLI, served by a real uvicorn server
and read by LlamaIndex; pages and sections reach every kind of source, and unreadable files are named."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import httpx
import pytest

from hypic_rag.cli.main import main
from hypic_rag.retrieval.corpus_index import CorpusIndex
from hypic_rag.retrieval.parsers import Location, location_metadata
from hypic_rag.retrieval.loading import load_corpus
from hypic_rag.testing import save_tiny_checkpoint

PDF_PAGES = [
    ["Annual report of the Orrin observatory.", "The Orrin observatory was founded in 1887 by Hedda Lusk."],
    ["The telescope of the Orrin observatory has a mirror 2.4 metres wide,", "polished by the optician Tomas Brede."],
]
HTML_PAGE = """<!doctype html>
<html><head><title>Kerran harbour guide</title>
<style>body { color: red } .ferry { display: none }</style>
<script>var timetable = "<p>SCRIPTMARKER</p>";</script></head>
<body><nav><a href="/">Home</a></nav>
<h1>Kerran harbour</h1><p>The harbour of <b>Kerran</b> is sheltered by two stone piers.</p>
<h2>Ferries</h2><p>The ferry to Lune island leaves from pier six every day at noon.</p>
<!-- COMMENTMARKER --></body></html>
"""
MARKDOWN = (
    "# Brindle bakery\n\nA family bakery on Market Street.\n\n## Opening hours\n\n"
    "The Brindle bakery opens at five in the morning and sells rye bread on Tuesdays.\n\n"
    "```\n# not a heading inside code\n```\n"
)
QUESTIONS = {  # question -> (document, expected location metadata)
    "How wide is the mirror of the Orrin observatory telescope?": ("report.pdf", {"page": 2}),
    "When does the ferry to Lune island leave?": ("harbour.html", {"section": "Kerran harbour > Ferries"}),
    "What must be worn in the welding bay of the workshop?": ("handbook.docx", {"section": "Workshop handbook > Safety"}),
    "When does the Brindle bakery open?": ("bakery.md", {"section": "Brindle bakery > Opening hours"}),
}
FACTS = {"report.pdf": "2.4 metres", "harbour.html": "pier six", "handbook.docx": "welding bay",
         "bakery.md": "five in the morning"}
UNREADABLE = {  # file -> words its skip reason must contain
    "broken.pdf": "damaged PDF",
    "locked.pdf": "encrypted PDF",
    "garbage.html": "binary file",
    "broken.docx": "not a readable DOCX",
}
CHUNK_TOKENS = 32


def write_pdf(path: Path, pages: list[list[str]], *, title: str | None = None, password: str | None = None) -> Path:
    """A real PDF with one line of Helvetica text per string, written by pypdf (page content streams by hand)."""
    from pypdf import PdfWriter
    from pypdf.generic import ContentStream, DictionaryObject, NameObject

    writer = PdfWriter()
    font = DictionaryObject({NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
                             NameObject("/BaseFont"): NameObject("/Helvetica")})
    for lines in pages:
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        operators = ["BT", "/F1 12 Tf", "14 TL", "72 720 Td"]
        for line in lines:
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            operators.append(f"({escaped}) Tj T*")
        operators.append("ET")
        content = ContentStream(None, None)
        content.set_data("\n".join(operators).encode("latin-1"))
        page.replace_contents(content)
    if title:
        writer.add_metadata({"/Title": title})
    if password:
        writer.encrypt(user_password=password, algorithm="RC4-128")
    with path.open("wb") as handle:
        writer.write(handle)
    return path


def write_docx(path: Path) -> Path:
    import docx

    document = docx.Document()
    document.core_properties.title = "Workshop handbook"
    document.add_heading("Workshop handbook", 0)
    document.add_paragraph("This handbook describes the workshop of the Kerran shipyard.")
    document.add_heading("Safety", 1)
    document.add_paragraph("A leather apron and a helmet must be worn in the welding bay at all times.")
    table = document.add_table(rows=1, cols=2)
    table.rows[0].cells[0].text, table.rows[0].cells[1].text = "Bay", "Welding"
    document.add_heading("Tools", 1)
    document.add_paragraph("The torque wrench is kept in the blue cabinet.")
    document.save(str(path))
    return path


def write_corpus(root: Path) -> Path:
    root.mkdir(parents=True)
    write_pdf(root / "report.pdf", PDF_PAGES, title="Orrin annual report")
    (root / "harbour.html").write_text(HTML_PAGE, encoding="utf-8")
    write_docx(root / "handbook.docx")
    (root / "bakery.md").write_text(MARKDOWN, encoding="utf-8")
    (root / "broken.pdf").write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\ntrailer <<")
    write_pdf(root / "locked.pdf", [["The vault code is 7781."]], password="secret")
    (root / "garbage.html").write_bytes(os.urandom(4096) + b"\0")
    (root / "broken.docx").write_bytes(b"PK\x03\x04 not really a zip")
    return root


def all_text(corpus_root: Path) -> str:
    return "\n".join(document.text for document in load_corpus(corpus_root).documents)


# ------------------------------------------------------------------------------------------------ loading
def test_each_format_loads_as_text_with_pages_and_sections(tmp_path: Path) -> None:
    corpus = load_corpus(write_corpus(tmp_path / "corpus"))
    by_id = {document.doc_id: document for document in corpus.documents}
    assert sorted(by_id) == ["bakery.md", "handbook.docx", "harbour.html", "report.pdf"]

    pdf = by_id["report.pdf"]
    assert "founded in 1887 by Hedda Lusk" in pdf.text and "mirror 2.4 metres wide" in pdf.text
    assert [location.page for location in pdf.locations] == [1, 2]
    assert pdf.text[pdf.locations[1].start:].startswith("The telescope of the Orrin")
    assert pdf.metadata == {"title": "Orrin annual report"}

    html = by_id["harbour.html"]
    assert "The harbour of Kerran is sheltered" in html.text and "pier six every day at noon" in html.text
    for markup in ("<", "SCRIPTMARKER", "COMMENTMARKER", "color: red"):
        assert markup not in html.text, markup
    assert [location.section for location in html.locations] == ["Kerran harbour", "Kerran harbour > Ferries"]
    assert html.metadata == {"title": "Kerran harbour guide"}

    docx_document = by_id["handbook.docx"]
    assert "helmet must be worn in the welding bay" in docx_document.text and "Bay | Welding" in docx_document.text
    assert [location.section for location in docx_document.locations] == [
        "Workshop handbook", "Workshop handbook > Safety", "Workshop handbook > Tools"]

    markdown = by_id["bakery.md"]
    assert markdown.text == MARKDOWN  # kept as written
    assert [location.section for location in markdown.locations] == ["Brindle bakery", "Brindle bakery > Opening hours"]


def test_unreadable_files_are_named_with_the_reason(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hypic_rag.retrieval.loading"):
        corpus = load_corpus(write_corpus(tmp_path / "corpus"))
    reasons = {skip.location: skip.reason for skip in corpus.skipped}
    assert sorted(reasons) == sorted(UNREADABLE)
    for name, words in UNREADABLE.items():
        assert words in reasons[name], (name, reasons[name])
        assert any(name in record.getMessage() and words in record.getMessage() for record in caplog.records), name
    assert "7781" not in all_text(tmp_path / "corpus")  # the encrypted PDF's text is not guessed at


def test_html_in_a_declared_encoding_and_as_a_single_file(tmp_path: Path) -> None:
    page = tmp_path / "cafe.htm"
    page.write_bytes('<html><head><meta charset="iso-8859-1"></head><body><h1>Caf\xe9</h1><p>Cr\xe8me br\xfbl\xe9e '
                     'every day.</p></body></html>'.encode("latin-1"))
    (document,) = load_corpus(page).documents
    assert document.text == "Caf\xe9\n\nCr\xe8me br\xfbl\xe9e every day." and document.locations[0].section == "Caf\xe9"
    deep = tmp_path / "deep.html"
    deep.write_text("<div>" * 5000 + "deep text" + "</div>" * 5000, encoding="utf-8")
    corpus = load_corpus(tmp_path)
    assert [d.doc_id for d in corpus.documents] == ["cafe.htm"]  # a pathological page is named, not a crash
    assert [(skip.location, skip.reason) for skip in corpus.skipped] == [("deep.html", "HTML nested too deeply to read")]


def test_a_single_pdf_is_never_read_as_its_operators(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "report.pdf", PDF_PAGES)
    (document,) = load_corpus(pdf).documents
    assert "Hedda Lusk" in document.text
    for operator in ("%PDF", " Tj", "/F1", "endobj"):
        assert operator not in document.text
    renamed = tmp_path / "report.txt"  # a PDF under a text name is still a PDF
    renamed.write_bytes(pdf.read_bytes())
    (document,) = load_corpus(renamed).documents
    assert "Hedda Lusk" in document.text and "endobj" not in document.text


def test_location_metadata_of_a_span() -> None:
    pages = [Location(0, page=1), Location(100, page=2), Location(200, page=3)]
    assert location_metadata(pages, 10, 90) == {"page": 1}
    assert location_metadata(pages, 150, 250) == {"page": 2, "page_end": 3}
    assert location_metadata(pages, 100, 200) == {"page": 2}
    sections = [Location(50, section="A"), Location(120, section="A > B")]
    assert location_metadata(sections, 0, 40) == {}
    assert location_metadata(sections, 0, 60) == {"section": "A"}  # starts before the first heading, holds it
    assert location_metadata(sections, 120, 300) == {"section": "A > B"}


# ----------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The corpus precomputed once through the real CLI on a tiny model."""
    work = tmp_path_factory.mktemp("formats")
    corpus = write_corpus(work / "corpus")
    texts = [document.text for document in load_corpus(corpus).documents] + list(QUESTIONS)
    model = save_tiny_checkpoint(work / "model", texts * 4)
    return {"corpus": corpus, "index": work / "index", "model": model}


@pytest.fixture(scope="module")
def precompute_output(built: dict[str, Path]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["precompute", str(built["corpus"]), "--index", str(built["index"]), "--model", str(built["model"]),
                     "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress", "--device", "cpu"])
    assert code == 0, out.getvalue()
    return out.getvalue()


def test_precompute_summary_names_every_unreadable_file(precompute_output: str) -> None:
    assert "documents: 4 (4 added" in precompute_output
    assert f"skipped: {len(UNREADABLE)} inputs" in precompute_output
    for name, words in UNREADABLE.items():
        assert f"  {name}: " in precompute_output and words in precompute_output, name


def test_index_chunks_carry_page_and_section(built: dict[str, Path], precompute_output: str) -> None:
    with CorpusIndex.open(built["index"]) as index:
        chunks = list(index.docstore.iter_chunks())
    for chunk in chunks:
        assert "<" not in chunk.text and " Tj" not in chunk.text
        if chunk.doc_id == "report.pdf":
            assert chunk.metadata["title"] == "Orrin annual report" and chunk.metadata["page"] in (1, 2)
        else:
            assert chunk.metadata["section"].startswith(("Kerran harbour", "Workshop handbook", "Brindle bakery"))
    facts = {doc_id: [c for c in chunks if c.doc_id == doc_id and fact in c.text] for doc_id, fact in FACTS.items()}
    assert all(facts.values()), facts


def ask_json(built: dict[str, Path], question: str, capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    code = main(["ask", "--index", str(built["index"]), question, "--json", "--top-k", "2", "--hop-slots", "0",
                 "--max-new-tokens", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_ask_finds_each_format_fact_with_its_page_or_section(
    built: dict[str, Path], precompute_output: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for question, (document, location) in QUESTIONS.items():
        answer = ask_json(built, question, capsys)
        found = [s for s in answer["sources"] if s["doc_id"] == document and FACTS[document] in s["text"]]
        assert found, (question, answer["sources"])
        assert location.items() <= found[0]["metadata"].items(), found[0]["metadata"]
    capsys.readouterr()
    question = "How wide is the mirror of the Orrin observatory telescope?"
    assert main(["ask", "--index", str(built["index"]), question, "--top-k", "1", "--hop-slots", "0",
                 "--max-new-tokens", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  \[1\] report\.pdf #\d+ \(score [\d.]+, page 2\): ", out, flags=re.MULTILINE), out


def test_server_sources_carry_page_and_section(built: dict[str, Path], precompute_output: str) -> None:
    from hypic_rag.server import ServerConfig
    from hypic_rag.server.runner import ServerThread

    with ServerThread(ServerConfig(index_dir=built["index"], device="cpu")) as running, \
            httpx.Client(base_url=running.url, timeout=120) as client:
        for question, (document, location) in list(QUESTIONS.items())[:2]:
            response = client.post("/v1/ask", json={"question": question, "top_k": 2, "max_new_tokens": 2})
            assert response.status_code == 200, response.text
            sources = [s for s in response.json()["sources"] if s["doc_id"] == document]
            assert sources and location.items() <= sources[0]["metadata"].items(), response.json()["sources"]
            assert all(s["hop_query"] is None for s in response.json()["sources"])  # top_k 2: no hop places


def test_llama_index_source_nodes_carry_page_and_section(built: dict[str, Path]) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core import VectorStoreIndex

    from hypic_rag.integrations.llama_index import HypicEmbedding
    from hypic_rag.integrations.llama_index_reader import HypicReader

    reader = HypicReader()
    documents = reader.load_data(built["corpus"])
    assert sorted(skip.location for skip in reader.skipped) == sorted(UNREADABLE)
    assert {document.metadata.get("page") for document in documents if document.metadata["doc_id"] == "report.pdf"} == {1, 2}
    retriever = VectorStoreIndex.from_documents(documents, embed_model=HypicEmbedding()).as_retriever(similarity_top_k=1)
    for question, (document, location) in QUESTIONS.items():
        (node,) = retriever.retrieve(question)
        assert node.node.metadata["doc_id"] == document and location.items() <= node.node.metadata.items(), question
        assert FACTS[document] in node.node.get_content()


def test_simple_directory_reader_reads_each_format_through_the_file_extractors(built: dict[str, Path]) -> None:
    """LlamaIndex's own walker with `file_extractors()`: PDF text (not its bytes), HTML without markup or script,
    DOCX; LlamaIndex's `file_name` / `file_path` with the page or section in every document; unreadable files are
    skipped (LlamaIndex prints their names) and everything else is read."""
    pytest.importorskip("llama_index.core")
    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.schema import MetadataMode

    from hypic_rag.integrations.llama_index_reader import file_extractors

    documents = SimpleDirectoryReader(str(built["corpus"]), file_extractor=file_extractors()).load_data()
    by_file: dict[str, list] = {}
    for document in documents:
        by_file.setdefault(document.metadata["file_name"], []).append(document)
        assert Path(document.metadata["file_path"]).name == document.metadata["file_name"]
        assert Path(document.metadata["file_path"]).is_file()
        for marker in ("SCRIPTMARKER", "COMMENTMARKER", "<p>", "%PDF", " Tj", "display: none"):
            assert marker not in document.text, (marker, document.metadata["file_name"])
        assert "doc_id" not in document.get_content(MetadataMode.LLM)
        assert f"file_path: {document.metadata['file_path']}" in document.get_content(MetadataMode.LLM)
    assert sorted(by_file) == sorted(FACTS)
    for question, (name, location) in QUESTIONS.items():
        holding = [d for d in by_file[name] if FACTS[name] in d.text]
        assert holding and location.items() <= holding[0].metadata.items(), (question, holding)
    assert {d.metadata["page"] for d in by_file["report.pdf"]} == {1, 2}
    assert {d.metadata["page_label"] for d in by_file["report.pdf"]} == {"1", "2"}
    assert len({document.id_ for document in documents}) == len(documents)


def test_a_docstore_made_before_chunk_metadata_opens_and_gains_it(tmp_path: Path) -> None:
    import sqlite3

    import numpy as np

    from hypic_rag.retrieval.chunking import Chunk
    from hypic_rag.retrieval.docstore import SCHEMA, DocStore
    from hypic_rag.retrieval.loading import Document

    path = tmp_path / "docstore.sqlite"
    old_schema = SCHEMA.replace(",\n    metadata TEXT NOT NULL DEFAULT '{}'\n);", "\n);")
    assert old_schema != SCHEMA
    with sqlite3.connect(path) as db:
        db.executescript(old_schema)
        db.execute("INSERT INTO documents VALUES ('old.txt', '/corpus', 'old.txt', 'digest', '{\"kind\": \"note\"}')")
        db.execute("INSERT INTO chunks (chunk_id, doc_id, position, text, token_ids, n_tokens, char_start, char_end, "
                   "embedding) VALUES ('c0', 'old.txt', 0, 'Old text.', ?, 2, 0, 9, ?)",
                   (np.asarray([1, 2], "<i4").tobytes(), np.zeros(4, "<f4").tobytes()))
    store = DocStore(path)
    try:
        (old,) = store.iter_chunks()
        assert old.metadata == {"kind": "note"}
        document = Document("new.pdf", "Page text.", "new.pdf", {"title": "T"}, (Location(0, page=1),))
        chunk = Chunk("c1", "new.pdf", 0, "Page text.", (3, 4), 0, 10, {"page": 1})
        store.replace_document(document, "/corpus", [chunk], {"c1": np.ones(4, dtype=np.float32)})
        assert [c.metadata for c in store.iter_chunks()] == [{"title": "T", "page": 1}, {"kind": "note"}]
    finally:
        store.close()
