"""Decompression bombs and slow files: what one DOCX, PDF or HTML file may inflate to and how long it may take to
parse are bounded; a file over a limit is skipped with a warning naming the limit and the load goes on. Real files:
a DOCX whose XML inflates to 5, 10 or 20 MB of empty paragraphs from ~40 KB (they took 88-310 s and 1.27 GB to
load), a PDF whose content stream inflates to 80 MB, a large HTML page."""

from __future__ import annotations

import io
import logging
import os
import tracemalloc
import zipfile
import zlib
from pathlib import Path

import pytest

from hypic_rag.retrieval.parsers import (
    PARSE_LIMITS,
    ParseLimits,
    UnreadableFile,
    parse_docx,
    parse_html,
    parse_pdf,
)
from hypic_rag.retrieval.loading import load_corpus

MIB = 1 << 20


def docx_bomb(inflated_bytes: int) -> bytes:
    """A real DOCX (python-docx) with one short paragraph, its document.xml padded with empty paragraphs to
    `inflated_bytes`: a few tens of KB on disk."""
    import docx

    document = docx.Document()
    document.add_paragraph("The only sentence of this document.")
    plain = io.BytesIO()
    document.save(plain)
    source = zipfile.ZipFile(io.BytesIO(plain.getvalue()))
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as archive:
        for member in source.infolist():
            data = source.read(member.filename)
            if member.filename == "word/document.xml":
                data = data.replace(b"<w:body>", b"<w:body>" + b"<w:p/>" * (inflated_bytes // 6), 1)
            archive.writestr(member, data)
    return bomb.getvalue()


def pdf_with_stream(content: bytes) -> bytes:
    """A one-page PDF (no xref table: pypdf rebuilds it) whose page content stream is `content`, Flate-compressed."""
    stream = zlib.compress(content, 9)
    return (b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n"
            b"2 0 obj << /Type /Pages /Kids [3 0 R] /Count 1 >> endobj\n"
            b"3 0 obj << /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >> endobj\n"
            + f"4 0 obj << /Length {len(stream)} /Filter /FlateDecode >> stream\n".encode() + stream
            + b"\nendstream endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n")


def refused(parse, raw: bytes, limits: ParseLimits = PARSE_LIMITS) -> tuple[str, int]:  # noqa: ANN001
    """The reason `parse` refuses `raw` and the peak memory it traced meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(UnreadableFile) as raised:
            parse(raw, limits)
        return str(raised.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("inflated", [5 * MIB, 10 * MIB, 20 * MIB])
def test_a_docx_bomb_is_refused_from_its_zip_directory(inflated: int) -> None:
    raw = docx_bomb(inflated)
    assert len(raw) < 100_000
    reason, peak = refused(parse_docx, raw)
    assert "word/document.xml inflates" in reason and "more than 200 times, the limit per part" in reason
    assert peak < 2 * MIB  # nothing was inflated


def test_a_docx_of_more_xml_than_the_limit_allows_is_refused_but_pictures_count_apart() -> None:
    reason, _ = refused(parse_docx, docx_bomb(5 * MIB), ParseLimits(max_inflated_bytes=2 * MIB, max_ratio=1e9))
    assert f"its XML parts inflate to more than {2 * MIB} bytes, the limit per file" in reason
    with_picture = io.BytesIO(docx_bomb(0))
    with zipfile.ZipFile(with_picture, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr("word/media/picture.bin", os.urandom(10 * MIB))  # 10 MB that do not compress
    limits = ParseLimits(max_inflated_bytes=2 * MIB)  # 0.8 MB of XML (python-docx's template) and the picture
    assert "The only sentence" in parse_docx(with_picture.getvalue(), limits).text
    reason, _ = refused(parse_docx, with_picture.getvalue(), ParseLimits(max_inflated_bytes=MIB))
    assert f"its parts inflate to more than {8 * MIB} bytes" in reason  # 8 times the limit, pictures included


def test_parsing_that_takes_longer_than_the_limit_stops_there() -> None:
    """With the size checks out of the way, the deadline stops a file that is slow to parse (hundreds of thousands
    of paragraphs); the message names the limit."""
    reason, _ = refused(parse_docx, docx_bomb(MIB), ParseLimits(max_ratio=1e9, max_seconds=0.05))
    assert "parsing took longer than 0.05 s, the limit per file" in reason
    html = ("<html><body>" + "<div><p>Some words here.</p></div>" * 2_000 + "</body></html>").encode()
    reason, _ = refused(parse_html, html, ParseLimits(max_seconds=1e-6))
    assert "longer than 1e-06 s" in reason
    assert "Some words here." in parse_html(html).text  # within the default limits it is read


def test_a_pdf_stream_bomb_is_refused_before_pypdf_inflates_it() -> None:
    reason, peak = refused(parse_pdf, pdf_with_stream(b" " * (80 * MIB)))
    assert f"its streams inflate to more than {64 * MIB} bytes, the limit per file" in reason
    assert peak < 8 * MIB  # measured a step at a time, never held
    image = zlib.compress(b"\0" * (80 * MIB))  # an image's stream: text extraction never decodes it
    picture = (b"5 0 obj << /Type /XObject /Subtype /Image /Width 8192 /Height 10240 /BitsPerComponent 8 "
               b"/ColorSpace /DeviceGray /Filter /FlateDecode >> stream\n" + image + b"\nendstream endobj\n")
    with_picture = pdf_with_stream(b"BT /F1 12 Tf 72 720 Td (A page with a picture.) Tj ET\n")
    with_picture = with_picture.replace(b"trailer", picture + b"trailer")
    reason, _ = refused(parse_pdf, with_picture)  # pypdf refuses this hand-made file, but not for its size
    assert "limit" not in reason, reason
    text = b"BT /F1 12 Tf 72 720 Td (A page within the limits.) Tj ET\n"
    reason, _ = refused(parse_pdf, pdf_with_stream(text * 1000), ParseLimits(max_inflated_bytes=10_000))
    assert "more than 10000 bytes" in reason


def test_an_html_file_over_the_size_limit_is_refused() -> None:
    reason, _ = refused(parse_html, b"<p>" + b"words " * 1000 + b"</p>", ParseLimits(max_inflated_bytes=1000))
    assert "the page has more than 1000 bytes, the limit per file" in reason


def test_the_loader_skips_a_bomb_with_a_warning_naming_the_limit_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "bomb.docx").write_bytes(docx_bomb(20 * MIB))
    (corpus / "bomb.pdf").write_bytes(pdf_with_stream(b" " * (80 * MIB)))
    (corpus / "notes.md").write_text("# Notes\n\nThe ferry leaves at noon.\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="hypic_rag.retrieval.loading"):
        loaded = load_corpus(corpus)
    assert [document.doc_id for document in loaded.documents] == ["notes.md"]
    reasons = {skipped.location: skipped.reason for skipped in loaded.skipped}
    assert "the limit per part" in reasons["bomb.docx"] and "the limit per file" in reasons["bomb.pdf"]
    warned = [record.getMessage() for record in caplog.records]
    assert any("bomb.docx" in line and "the limit per part" in line for line in warned), warned
    assert loaded.load_seconds > 0  # precompute's elapsed time counts loading (it said 2.25 s after 88 s)
