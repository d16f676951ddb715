"""Load a corpus: a directory (searched recursively) or a single file of `.txt`, `.md`, `.jsonl`, `.pdf`, `.html`
or `.docx` documents.

Document ids are stable names, so re-ingesting a corpus finds the documents it already holds:
- a file: its path relative to the corpus root, with `/` separators (a single file: its name);
- a `.jsonl` record: its `id` field when present, else `<file>:<line number>`.

PDF, HTML and DOCX files are read by their parsers (`parsers.py`), Markdown is kept as written with its headings
found; their pages or sections become `Document.locations`, carried into each chunk's metadata. Files that cannot
be read (unreadable, binary, not UTF-8, a damaged or encrypted PDF, a damaged DOCX, no text) are skipped with a
warning that names them; so are directories that cannot be listed and malformed `.jsonl` lines (named
`file:line`). Hidden files and folders (names
starting with `.`) and files of other types inside a directory are ignored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypic_rag.retrieval.errors import CorpusNotFoundError, EmptyCorpusError
from hypic_rag.retrieval.parsers import (
    Location,
    ParsedText,
    UnreadableFile,
    markdown_locations,
    parse_docx,
    parse_html,
    parse_pdf,
)

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt"})
MARKDOWN_SUFFIXES = frozenset({".md", ".markdown"})
JSONL_SUFFIXES = frozenset({".jsonl"})
PDF_SUFFIXES = frozenset({".pdf"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
DOCX_SUFFIXES = frozenset({".docx"})
PARSED_SUFFIXES = {**dict.fromkeys(PDF_SUFFIXES, parse_pdf), **dict.fromkeys(HTML_SUFFIXES, parse_html),
                   **dict.fromkeys(DOCX_SUFFIXES, parse_docx)}
CORPUS_SUFFIXES = TEXT_SUFFIXES | MARKDOWN_SUFFIXES | JSONL_SUFFIXES | frozenset(PARSED_SUFFIXES)
FORMATS_NOTE = ".txt, .md, .jsonl, .pdf, .html or .docx"
BINARY_SNIFF_BYTES = 8192
PDF_MAGIC = b"%PDF-"


@dataclass(frozen=True, slots=True)
class Document:
    """One document of the corpus.

    doc_id: stable id (see module docstring). source: where it came from, relative to the corpus root.
    metadata: JSON-serialisable fields kept with every chunk (for `.jsonl`, every field but `text` and `id`; for
    PDF, HTML and DOCX, `title` when the file names one). locations: where pages or sections start in `text`
    (sorted), from which each chunk gets `page` / `page_end` or `section` metadata.
    """

    doc_id: str
    text: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)
    locations: tuple[Location, ...] = ()

    def __post_init__(self) -> None:
        if not self.doc_id:
            raise ValueError("doc_id must be non-empty")

    @property
    def content_sha256(self) -> str:
        """Digest of the text, metadata and locations: equal digests mean the document is unchanged."""
        digest = hashlib.sha256(self.text.encode("utf-8"))
        digest.update(b"\0" + json.dumps(self.metadata, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        if self.locations:  # absent for plain text, whose digests stay what they were
            located = [location.as_dict() for location in self.locations]
            digest.update(b"\0" + json.dumps(located, sort_keys=True, ensure_ascii=False).encode("utf-8"))
        return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class SkippedInput:
    """A file or a `.jsonl` line that was not loaded, and why."""

    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass(slots=True)
class LoadedCorpus:
    """What `load_corpus` found. root: the resolved corpus path (directory or single file). load_seconds: how long
    loading took (parsing included; precompute's elapsed time counts it)."""

    root: Path
    documents: list[Document]
    skipped: list[SkippedInput]
    ignored_files: int = 0
    load_seconds: float = 0.0


def _read_text_file(path: Path, location: str, skipped: list[SkippedInput]) -> str | None:
    """The file's text, or None after recording why it was skipped."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        _skip(skipped, location, f"unreadable ({error.strerror or error})")
        return None
    if b"\0" in raw[:BINARY_SNIFF_BYTES]:
        _skip(skipped, location, "binary file")
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        _skip(skipped, location, f"not UTF-8 text (byte {error.start})")
        return None


def _skip(skipped: list[SkippedInput], location: str, reason: str) -> None:
    skipped.append(SkippedInput(location, reason))  # logged by `load_corpus` (named in its error if nothing loads)


def _load_text_document(path: Path, relative: str, skipped: list[SkippedInput]) -> list[Document]:
    text = _read_text_file(path, relative, skipped)
    if text is None:
        return []
    if not text.strip():
        _skip(skipped, relative, "no text")
        return []
    locations = tuple(markdown_locations(text)) if path.suffix.lower() in MARKDOWN_SUFFIXES else ()
    return [Document(doc_id=relative, text=text, source=relative, locations=locations)]


def _load_parsed_document(path: Path, relative: str, skipped: list[SkippedInput], parse: Any) -> list[Document]:
    """A PDF, HTML or DOCX file through its parser; a file it cannot read is skipped by name, with the reason."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        _skip(skipped, relative, f"unreadable ({error.strerror or error})")
        return []
    if parse is parse_html and b"\0" in raw[:BINARY_SNIFF_BYTES]:
        _skip(skipped, relative, "binary file, not HTML")
        return []
    try:
        parsed: ParsedText = parse(raw)
    except UnreadableFile as error:
        _skip(skipped, relative, str(error))
        return []
    return [Document(doc_id=relative, text=parsed.text, source=relative, metadata=parsed.metadata,
                     locations=tuple(parsed.locations))]


def _load_jsonl_documents(path: Path, relative: str, skipped: list[SkippedInput]) -> list[Document]:
    content = _read_text_file(path, relative, skipped)
    if content is None:
        return []
    documents = []
    for line_number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        location = f"{relative}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            _skip(skipped, location, f"malformed JSON ({error.msg} at column {error.colno})")
            continue
        if not isinstance(record, dict):
            _skip(skipped, location, "not a JSON object")
            continue
        text = record.get("text")
        if not isinstance(text, str) or not text.strip():
            _skip(skipped, location, "no non-empty 'text' string field")
            continue
        raw_id = record.get("id")
        if raw_id is not None and not isinstance(raw_id, (str, int)):
            _skip(skipped, location, "'id' must be a string or an integer")
            continue
        doc_id = str(raw_id) if raw_id is not None and str(raw_id) else location
        metadata = {key: value for key, value in record.items() if key not in ("text", "id")}
        documents.append(Document(doc_id=doc_id, text=text, source=location, metadata=metadata))
    return documents


def _is_pdf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(len(PDF_MAGIC)) == PDF_MAGIC
    except OSError:
        return False


def _load_file(path: Path, relative: str, skipped: list[SkippedInput]) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _load_jsonl_documents(path, relative, skipped)
    if suffix in PARSED_SUFFIXES:
        return _load_parsed_document(path, relative, skipped, PARSED_SUFFIXES[suffix])
    if _is_pdf(path):  # a PDF under another name is still read as a PDF, never as its operators
        return _load_parsed_document(path, relative, skipped, parse_pdf)
    return _load_text_document(path, relative, skipped)


def load_file(path: Path, relative: str) -> tuple[list[Document], list[SkippedInput]]:
    """One corpus file's documents (`relative`: its id-giving path) and the inputs of it that were skipped."""
    skipped: list[SkippedInput] = []
    return _load_file(path, relative, skipped), skipped


FileLoader = Callable[[Sequence[tuple[Path, str]]], Iterable[tuple[list[Document], list[SkippedInput]]]]
"""Loads (path, relative path) files, yielding `load_file`'s result for each in the given order (this process's
loop by default; Ray tasks with `hypic_rag.distributed.ray_ingest`)."""


def load_files_here(files: Sequence[tuple[Path, str]]) -> Iterable[tuple[list[Document], list[SkippedInput]]]:
    """`load_file` of each file in turn, in this process."""
    return (load_file(path, relative) for path, relative in files)


def _is_hidden(relative_parts: tuple[str, ...]) -> bool:
    return any(part.startswith(".") for part in relative_parts)


def _corpus_files(root: Path, skipped: list[SkippedInput]) -> tuple[list[Path], int]:
    """Supported files under `root` in a stable order, and how many other files were ignored; a directory that
    cannot be listed is skipped by name (not left out silently)."""

    def unlisted(error: OSError) -> None:
        location = Path(error.filename).relative_to(root).as_posix() if error.filename else "."
        _skip(skipped, location + "/", f"unreadable directory ({error.strerror or error})")

    found = []
    for directory, subdirectories, names in os.walk(root, onerror=unlisted):  # symlinked directories not followed
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".")]
        found.extend(Path(directory) / name for name in names)
    files, ignored = [], 0
    for path in sorted(found):
        relative_parts = path.relative_to(root).parts
        if _is_hidden(relative_parts) or path.is_dir():
            continue
        if path.suffix.lower() in CORPUS_SUFFIXES:
            files.append(path)
        else:
            ignored += 1
            logger.debug("ignored %s (not %s)", path, FORMATS_NOTE)
    return files, ignored


def load_corpus(path: str | Path, *, load_files: FileLoader = load_files_here) -> LoadedCorpus:
    """Load every document under `path` (a directory, recursively, or one file).

    Raises CorpusNotFoundError for a missing path and EmptyCorpusError when nothing loadable is found.
    A document id seen twice keeps its first occurrence; the later one is skipped with a warning.
    `load_files` reads the files (in order; whoever reads them, the result is the same).
    """
    began = time.perf_counter()
    root = Path(path).expanduser()
    if not root.exists():
        raise CorpusNotFoundError(f"corpus path {str(path)!r} does not exist")
    root = root.resolve()
    skipped: list[SkippedInput] = []
    if root.is_dir():
        files, ignored = _corpus_files(root, skipped)
        named = [(file, file.relative_to(root).as_posix()) for file in files]
    else:
        ignored, named = 0, [(root, root.name)]
    loaded: list[Document] = []
    for documents, file_skips in load_files(named):
        loaded.extend(documents)
        skipped.extend(file_skips)
    documents, seen = [], set()
    for document in loaded:
        if document.doc_id in seen:
            _skip(skipped, document.source, f"duplicate document id {document.doc_id!r}")
            continue
        seen.add(document.doc_id)
        documents.append(document)
    if not documents:
        named = "; ".join(str(entry) for entry in skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
        detail = f" ({len(skipped)} inputs skipped: {named})" if skipped else ""
        raise EmptyCorpusError(f"corpus {str(root)!r} holds no {FORMATS_NOTE} document with text{detail}")
    for entry in skipped:
        logger.warning("skipped %s", entry)
    logger.info("loaded %d documents from %s (%d skipped, %d ignored)", len(documents), root, len(skipped), ignored)
    return LoadedCorpus(root=root, documents=documents, skipped=skipped, ignored_files=ignored,
                        load_seconds=time.perf_counter() - began)
