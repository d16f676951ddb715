"""Text and locations of PDF, HTML, DOCX and Markdown files, through maintained parsers.

Each `parse_*` function takes a file's bytes and returns a `ParsedText`: the plain text that is chunked, embedded
and shown as sources, its `Location`s (from which character on a page or a section applies, carried into every
chunk's metadata as `page` / `page_end` or `section`), and document metadata (`title` when the file names one).
A file the parser cannot read raises `UnreadableFile` with a one-line reason; the loader names the file in a
warning and in the precompute summary. No parser ever returns raw markup or PDF operators as text.

Parsers (why these: docs/retrieval.md, "Document formats"):
- PDF: pypdf (pure Python, BSD), text per page; encrypted files are tried with the empty password only.
- HTML: BeautifulSoup 4 with the standard library's `html.parser` (MIT, no compiled parts); scripts, styles and
  the head are dropped, blocks become paragraphs, `h1`-`h6` headings open sections.
- DOCX: python-docx (MIT), paragraphs and tables in document order; `Title` / `Heading N` styles open sections.
- Markdown: the text is kept as written; markdown-it-py (MIT, CommonMark) finds its headings (ATX and setext,
  never a `#` inside a code block).

What one file may cost is bounded (`ParseLimits`): what its compressed parts may inflate to (a DOCX's zip members,
a PDF's Flate streams, measured before the parser sees them) and an HTML file's size; how many times a large DOCX
part may inflate its compressed size (zip bombs); how long parsing may take (checked between pages, blocks and
elements). A file over a limit raises `UnreadableFile` naming the limit, so the loader skips it with a warning and
goes on with the next file (a 30 KB DOCX inflating to 5 MB of empty paragraphs took minutes).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from hypic_rag.errors import EXIT_BAD_INPUT, HypicError


class UnreadableFile(HypicError, ValueError):
    """A file its parser cannot turn into text; the message is the reason, one line. The loader skips the file,
    naming it; raised to the command line it would be bad input (exit 2)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True, slots=True)
class Location:
    """From character `start` of a document's text on (until the next location): its page (1-based) or its
    section (the heading path, outermost first, joined by " > ")."""

    start: int
    page: int | None = None
    section: str | None = None

    def as_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"start": self.start}
        if self.page is not None:
            found["page"] = self.page
        if self.section is not None:
            found["section"] = self.section
        return found


@dataclass(slots=True)
class ParsedText:
    """A parsed file: its text, locations (sorted by start) and document metadata."""

    text: str
    locations: list[Location] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


SECTION_SEPARATOR = " > "
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufffd]")
"""C0 and C1 control characters (tab and newlines excepted) and U+FFFD, what bytes that are not text decode to."""
MAX_CONTROL_FRACTION = 0.01
"""Text with more than this fraction of control characters is binary data, not a document."""


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """What parsing one file may cost; a file over a limit is `UnreadableFile` naming it (the loader skips it).

    max_inflated_bytes: what the parts a parser reads may inflate to, together (a DOCX's XML parts, a PDF's Flate
    streams but its images), and the most bytes an HTML file may have; a DOCX's parts of every kind (pictures
    included) may take `ALL_PARTS_FACTOR` times as much. max_ratio: how many times its compressed size a DOCX part
    of over `RATIO_FLOOR_BYTES` may inflate (XML compresses 5-20x; a bomb, thousands of times). max_seconds: how
    long parsing one file may take.
    """

    max_inflated_bytes: int = 64 << 20
    max_ratio: float = 200.0
    max_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.max_inflated_bytes < 1 or not self.max_ratio > 1 or not self.max_seconds > 0:
            raise ValueError(f"parse limits must be positive (ratio > 1), got {self}")


PARSE_LIMITS = ParseLimits()
RATIO_FLOOR_BYTES = 1 << 20
"""DOCX parts up to this size are never refused for their compression ratio (a small part may compress well)."""
ALL_PARTS_FACTOR = 8
"""A DOCX's parts of every kind may inflate to this many times `max_inflated_bytes` (pictures are read whole)."""


class _Deadline:
    """`check()` raises `UnreadableFile` naming the limit once parsing has taken longer than `limits.max_seconds`."""

    def __init__(self, limits: ParseLimits) -> None:
        self.limits = limits
        self.ends = time.monotonic() + limits.max_seconds

    def check(self) -> None:
        if time.monotonic() > self.ends:
            raise UnreadableFile(f"parsing took longer than {self.limits.max_seconds:g} s, the limit per file "
                                 "(a decompression bomb, or a pathological file?)")


def _too_large(what: str, limits: ParseLimits) -> UnreadableFile:
    return UnreadableFile(f"{what} more than {limits.max_inflated_bytes} bytes, the limit per file "
                          "(a decompression bomb?)")


def location_metadata(locations: Sequence[Location], start: int, end: int) -> dict[str, Any]:
    """Chunk metadata for the span [start, end) of a document with `locations` (sorted by start): the page the span
    starts on (`page`, and `page_end` when it runs onto a later page) and the section it starts in (`section`);
    a span that starts before the first location takes the first one inside it. Empty when none applies (a span
    wholly before the first heading)."""
    current: Location | None = None
    last_page: int | None = None
    for location in locations:
        if location.start >= end:
            break
        if location.start <= start or current is None:
            current = location
        if location.page is not None:
            last_page = location.page
    found: dict[str, Any] = {}
    if current is not None and current.page is not None:
        found["page"] = current.page
        if last_page is not None and last_page != current.page:
            found["page_end"] = last_page
    if current is not None and current.section is not None:
        found["section"] = current.section
    return found


def looks_binary(text: str) -> bool:
    """Whether decoded text is mostly not text (more than 1% control characters other than tab and newlines)."""
    return binary_fraction(text) > MAX_CONTROL_FRACTION


def binary_reason(text: str) -> str:
    """Why `text` is refused as binary data, naming the limit."""
    return (f"binary data, not text ({100 * binary_fraction(text):.0f}% control characters; text has at most "
            f"{100 * MAX_CONTROL_FRACTION:g}%)")


def binary_fraction(text: str) -> float:
    """The fraction of `text` that are control characters (tab and newlines excepted) or U+FFFD."""
    return CONTROL_CHARACTERS.subn("", text)[1] / len(text) if text else 0.0


class _Builder:
    """Paragraphs joined by blank lines, with a location recorded where each section or page starts."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.locations: list[Location] = []
        self._headings: list[tuple[int, str]] = []  # (level, title) of the open sections, outermost first

    def paragraph(self, text: str) -> None:
        text = text.strip()
        if not text:
            return
        if self.parts:
            self.parts.append("\n\n")
            self.length += 2
        self.parts.append(text)
        self.length += len(text)

    def heading(self, level: int, title: str) -> None:
        """Open a section at `level` (1 outermost) named `title`; its heading line is a paragraph of the text."""
        title = " ".join(title.split())
        if not title:
            return
        while self._headings and self._headings[-1][0] >= level:
            self._headings.pop()
        self._headings.append((level, title))
        self.paragraph(title)
        start = self.length - len(title)
        self._locate(Location(start, section=SECTION_SEPARATOR.join(name for _, name in self._headings)))

    def page(self, number: int, text: str) -> None:
        before = self.length
        self.paragraph(text)
        if self.length > before:
            self._locate(Location(self.length - len(text.strip()), page=number))

    def _locate(self, location: Location) -> None:
        if self.locations and self.locations[-1].start == location.start:
            self.locations[-1] = location
        else:
            self.locations.append(location)

    def result(self, metadata: dict[str, Any]) -> ParsedText:
        text = "".join(self.parts)
        if not text.strip():
            raise UnreadableFile("no text")
        if looks_binary(text):
            raise UnreadableFile(binary_reason(text))
        return ParsedText(text, self.locations, metadata)


def _failure(error: Exception) -> str:
    detail = " ".join(str(error).split())[:200]
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


# ------------------------------------------------------------------------------------------------------- PDF
def parse_pdf(raw: bytes, limits: ParseLimits = PARSE_LIMITS) -> ParsedText:
    """Text of every page (pypdf's layout-free extraction), each page a location. Raises UnreadableFile for a
    damaged file, an encrypted one that needs a password, one without extractable text (scanned images), or one
    over `limits` (its Flate streams inflating beyond `max_inflated_bytes`, measured before pypdf reads it; its
    pages taking longer than `max_seconds`)."""
    deadline = _Deadline(limits)
    _check_pdf_streams(raw, limits, deadline)
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, PyPdfError

    with _quiet_pypdf():
        return _parse_pdf(raw, PdfReader, DependencyError, PyPdfError, limits, deadline)


_PDF_STREAM = re.compile(rb"stream\r?\n")
_PDF_IMAGE = re.compile(rb"/Subtype\s*/Image\b")
INFLATE_STEP_BYTES = 1 << 20


def _check_pdf_streams(raw: bytes, limits: ParseLimits, deadline: _Deadline) -> None:
    """`UnreadableFile` when the file's zlib (Flate) streams but its images (which text extraction never decodes)
    inflate to more than `limits.max_inflated_bytes` together; each is inflated a step at a time and thrown away,
    so measuring costs no memory. Streams that are not zlib do not inflate here and count nothing."""
    total = 0
    position = 0
    while True:
        found = _PDF_STREAM.search(raw, position)
        if found is None:
            return
        start = found.end()
        end = raw.find(b"endstream", start)
        end = len(raw) if end < 0 else end
        position = end + 9
        header = raw[max(0, found.start() - 4096) : found.start()]
        if _PDF_IMAGE.search(header[header.rfind(b" obj") + 1 :]):
            continue
        total += _inflated_size(raw[start:end], limits.max_inflated_bytes - total + 1, deadline)
        if total > limits.max_inflated_bytes:
            raise _too_large("its streams inflate to", limits)


def _inflated_size(data: bytes, budget: int, deadline: _Deadline) -> int:
    """Bytes `data` inflates to as a zlib stream (its own size when it is not one), counted up to `budget`."""
    inflater = zlib.decompressobj()
    try:
        size = len(inflater.decompress(data, INFLATE_STEP_BYTES))
        while inflater.unconsumed_tail and size < budget:
            deadline.check()
            size += len(inflater.decompress(inflater.unconsumed_tail, INFLATE_STEP_BYTES))
    except zlib.error:
        return 0
    return size


@contextlib.contextmanager
def _quiet_pypdf() -> Iterator[None]:
    """pypdf's warnings about a damaged file ("EOF marker not found", "Ignoring wrong pointing object") do not name
    the file and come before the loader's own line that does: kept to debug logging unless pypdf's logger was
    configured."""
    pypdf_logger = logging.getLogger("pypdf")
    if pypdf_logger.level != logging.NOTSET:
        yield
        return
    pypdf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pypdf_logger.setLevel(logging.NOTSET)


def _parse_pdf(raw: bytes, PdfReader: Any, DependencyError: type, PyPdfError: type, limits: ParseLimits,
               deadline: _Deadline) -> ParsedText:
    try:
        reader = PdfReader(io.BytesIO(raw))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")
            except DependencyError:
                raise UnreadableFile("encrypted PDF (AES: needs the `cryptography` package and a password)") from None
            if not opened:
                raise UnreadableFile("encrypted PDF (needs a password); save an unencrypted copy to index it")
        builder = _Builder()
        for number, page in enumerate(reader.pages, start=1):
            deadline.check()
            builder.page(number, page.extract_text() or "")
            if builder.length > limits.max_inflated_bytes:
                raise _too_large("its text holds", limits)
        metadata: dict[str, Any] = {}
        title = reader.metadata.title if reader.metadata is not None else None
        if isinstance(title, str) and title.strip():
            metadata["title"] = " ".join(title.split())
    except UnreadableFile:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, RecursionError) as error:
        # pypdf raises more than its own errors on damaged files (a missing key, a bad number, a cycle)
        raise UnreadableFile(f"damaged PDF ({_failure(error)})") from None
    if not builder.parts:
        raise UnreadableFile("PDF without extractable text (scanned pages? run OCR on it first)")
    return builder.result(metadata)


# ------------------------------------------------------------------------------------------------------ HTML
_HTML_DROPPED = frozenset({"script", "style", "noscript", "template", "head", "svg", "math", "iframe", "object",
                           "canvas", "button", "select", "textarea"})
_HTML_BLOCKS = frozenset({
    "p", "div", "section", "article", "main", "header", "footer", "nav", "aside", "ul", "ol", "li", "dl", "dt", "dd",
    "table", "thead", "tbody", "tfoot", "tr", "caption", "blockquote", "pre", "figure", "figcaption", "form",
    "fieldset", "address", "details", "summary", "hr", "body", "html", "center",
})
_HTML_CELLS = frozenset({"td", "th"})
_HTML_HEADINGS = {f"h{level}": level for level in range(1, 7)}


def _decode_html(raw: bytes) -> str:
    from bs4.dammit import EncodingDetector

    declared = EncodingDetector.find_declared_encoding(raw, is_html=True, search_entire_document=False)
    for encoding in (declared, "utf-8-sig"):
        if not encoding:
            continue
        try:
            return raw.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            continue
    raise UnreadableFile("not UTF-8 text and no valid charset declared")


def parse_html(raw: bytes, limits: ParseLimits = PARSE_LIMITS) -> ParsedText:
    """Visible text of an HTML page: blocks as paragraphs, headings as sections, `<title>` as metadata; a file of
    more than `limits.max_inflated_bytes` bytes, or that takes longer than `limits.max_seconds`, is refused."""
    from bs4 import BeautifulSoup
    from bs4.element import (
        Comment,
        Doctype,
        NavigableString,
        ProcessingInstruction,
        Tag,
    )

    if len(raw) > limits.max_inflated_bytes:
        raise _too_large("the page has", limits)
    deadline = _Deadline(limits)
    soup = BeautifulSoup(_decode_html(raw), "html.parser")
    deadline.check()
    metadata: dict[str, Any] = {}
    if soup.title is not None and soup.title.get_text(strip=True):
        metadata["title"] = " ".join(soup.title.get_text().split())
    builder = _Builder()
    inline: list[str] = []
    preformatted = [False]  # inside <pre>: white space kept

    def flush() -> None:
        text = "".join(inline) if preformatted[0] else " ".join("".join(inline).split()).removesuffix(" |")
        builder.paragraph(text)
        inline.clear()

    def walk(node: Tag) -> None:
        deadline.check()
        for child in node.children:
            if isinstance(child, (Comment, Doctype, ProcessingInstruction)):
                continue
            if isinstance(child, NavigableString):
                inline.append(str(child))
                continue
            if not isinstance(child, Tag) or child.name in _HTML_DROPPED:
                continue
            if child.name in _HTML_HEADINGS:
                flush()
                builder.heading(_HTML_HEADINGS[child.name], child.get_text(" "))
            elif child.name == "br":
                inline.append("\n" if preformatted[0] else " ")
            elif child.name == "pre":
                flush()
                preformatted[0] = True
                walk(child)
                flush()
                preformatted[0] = False
            elif child.name in _HTML_BLOCKS:
                flush()
                walk(child)
                flush()
            elif child.name in _HTML_CELLS:
                walk(child)
                inline.append(" | ")
            else:
                walk(child)

    try:
        walk(soup)
    except RecursionError:
        raise UnreadableFile("HTML nested too deeply to read") from None
    flush()
    return builder.result(metadata)


# ------------------------------------------------------------------------------------------------------ DOCX
_DOCX_HEADING = re.compile(r"^heading\s*([1-9])$", re.IGNORECASE)


def _docx_blocks(document: Any, deadline: _Deadline) -> Iterator[tuple[int | None, str]]:
    """(heading level or None, text) of the body's paragraphs and tables, in document order; the deadline is
    checked before each one."""
    from docx.table import Table

    levels: dict[object, int | None] = {}  # style id -> heading level (python-docx looks a style up in O(styles))
    for item in document.iter_inner_content():
        deadline.check()
        if isinstance(item, Table):
            rows = [" | ".join(cell.text.strip() for cell in row.cells) for row in item.rows]
            yield None, "\n".join(row for row in rows if row.strip(" |"))
            continue
        style_id = getattr(getattr(item, "_p", None), "style", item)  # the item itself: no cache without the id
        if style_id not in levels:
            style = (item.style.name if item.style is not None else "") or ""
            match = _DOCX_HEADING.match(style.strip())
            levels[style_id] = 0 if style.strip().lower() == "title" else int(match.group(1)) if match else None
        yield levels[style_id], item.text


def _check_zip_inflation(raw: bytes, limits: ParseLimits) -> None:
    """`UnreadableFile` when a zip's XML members declare more than `limits.max_inflated_bytes` together (all its
    members more than `ALL_PARTS_FACTOR` times that), or a large one inflates more than `limits.max_ratio` times
    its compressed size. The declared sizes bind: zipfile never returns more than a member declares (a lying
    member fails its CRC check)."""
    try:
        members = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError):
        return  # python-docx reports a damaged file with its own reason
    markup = everything = 0
    for member in members:
        everything += member.file_size
        if member.filename.endswith((".xml", ".rels")):
            markup += member.file_size
        if markup > limits.max_inflated_bytes:
            raise _too_large("its XML parts inflate to", limits)
        if everything > ALL_PARTS_FACTOR * limits.max_inflated_bytes:
            raise UnreadableFile(f"its parts inflate to more than {ALL_PARTS_FACTOR * limits.max_inflated_bytes} "
                                 "bytes, the limit per file (a decompression bomb?)")
        ratio = member.file_size / max(member.compress_size, 1)
        if member.file_size > RATIO_FLOOR_BYTES and ratio > limits.max_ratio:
            raise UnreadableFile(f"its part {member.filename} inflates {ratio:.0f} times ({member.compress_size} "
                                 f"to {member.file_size} bytes), more than {limits.max_ratio:g} times, the limit per "
                                 "part (a decompression bomb?)")


def parse_docx(raw: bytes, limits: ParseLimits = PARSE_LIMITS) -> ParsedText:
    """Paragraphs and tables of a Word document; `Title` and `Heading N` paragraphs open sections. A file whose
    parts inflate beyond `limits` (measured from the zip's directory before any part is read) or that takes
    longer than `limits.max_seconds` is refused."""
    import docx
    from docx.opc.exceptions import PackageNotFoundError

    _check_zip_inflation(raw, limits)
    deadline = _Deadline(limits)
    try:
        document = docx.Document(io.BytesIO(raw))
        blocks = list(_docx_blocks(document, deadline))
        title = document.core_properties.title
    except UnreadableFile:
        raise
    except (PackageNotFoundError, zipfile.BadZipFile, KeyError, ValueError, AttributeError, TypeError) as error:
        raise UnreadableFile(f"not a readable DOCX file ({_failure(error)})") from None
    except Exception as error:  # lxml's XMLSyntaxError and friends on a damaged part
        if type(error).__module__.startswith(("lxml", "docx")):
            raise UnreadableFile(f"not a readable DOCX file ({_failure(error)})") from None
        raise
    builder = _Builder()
    for level, text in blocks:
        if level is None:
            builder.paragraph(text)
        else:
            builder.heading(level + 1, text)  # Title is outermost, then Heading 1, ...
    metadata = {"title": " ".join(title.split())} if isinstance(title, str) and title.strip() else {}
    return builder.result(metadata)


# -------------------------------------------------------------------------------------------------- Markdown
_NEWLINE = re.compile(r"\r\n?|\n")


def markdown_locations(text: str) -> list[Location]:
    """The sections of a Markdown text as it is written: one location at each heading's first line."""
    from markdown_it import MarkdownIt

    line_starts = [0] + [match.end() for match in _NEWLINE.finditer(text)]
    tokens = MarkdownIt("commonmark").parse(text)
    headings: list[tuple[int, str]] = []
    locations: list[Location] = []
    for number, token in enumerate(tokens):
        if token.type != "heading_open" or token.map is None or number + 1 >= len(tokens):
            continue
        level = int(token.tag[1:])
        title = " ".join(tokens[number + 1].content.split())
        if not title:
            continue
        while headings and headings[-1][0] >= level:
            headings.pop()
        headings.append((level, title))
        start = line_starts[min(token.map[0], len(line_starts) - 1)]
        locations.append(Location(start, section=SECTION_SEPARATOR.join(name for _, name in headings)))
    return locations
