"""A LlamaIndex reader over hypic-rag's loader: PDF, HTML, DOCX, Markdown, text and `.jsonl`, with pages and sections.

    from llama_index.core import SimpleDirectoryReader
    from hypic_rag.integrations.llama_index_reader import HypicReader, file_extractors
    documents = SimpleDirectoryReader("docs/", file_extractor=file_extractors()).load_data()
    documents = HypicReader().load_data("docs/")                   # the same, without LlamaIndex's walker

`file_extractors()` maps every suffix hypic-rag reads (`.pdf`, `.html`, `.htm`, `.xhtml`, `.docx`, `.md`,
`.markdown`, `.txt`, `.jsonl`) to a `HypicReader`, so `SimpleDirectoryReader` reads PDF text (not the file's
bytes), HTML without markup or scripts, and DOCX, as `precompute` does. Each page of a PDF and each section of an
HTML, DOCX or Markdown file becomes one LlamaIndex `Document` whose metadata holds LlamaIndex's usual `file_name`
and `file_path`, `page` (and `page_label`, LlamaIndex's name for it) or `section` (the heading path, "Guide >
Setup"), the file's `title` when it names one, and hypic-rag's `doc_id` and `source` (the names every surface
uses, `hypic_rag/pipeline/vocabulary.py`); node parsers copy it into every node, so a query engine's `source_nodes` say
where each answer came from. As LlamaIndex's readers do, the bookkeeping keys (`file_name`, `doc_id`, `source`,
`page_label`) are left out of the text the embedder and the LLM see; `file_path`, `title`, `page` and `section`
stay in. Files that cannot be read are named in a warning (the loader's) and listed in `reader.skipped`; a folder
with nothing readable raises `EmptyCorpusError` (inside `SimpleDirectoryReader`, which then skips the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from llama_index.core.readers.base import BaseReader
    from llama_index.core.schema import Document as LlamaDocument
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "hypic_rag.integrations.llama_index_reader needs llama-index-core 0.14: install it with "
        "`pip install 'hypic-rag[llamaindex]'`"
    ) from error

from hypic_rag.retrieval.parsers import Location
from hypic_rag.retrieval.loading import CORPUS_SUFFIXES, Document, SkippedInput, load_corpus

__all__ = ["HIDDEN_METADATA_KEYS", "HypicReader", "file_extractors"]

HIDDEN_METADATA_KEYS = ("file_name", "doc_id", "source", "page_label")
"""Metadata kept with every document but left out of the text the embedder and the LLM see."""


def _pieces(document: Document) -> list[tuple[str, Location | None]]:
    """The document's text cut where its pages or sections start: (text, the location it lies in)."""
    starts: list[tuple[int, Location | None]] = [(0, None)] + [(loc.start, loc) for loc in document.locations]
    pieces = []
    for number, (start, location) in enumerate(starts):
        end = starts[number + 1][0] if number + 1 < len(starts) else len(document.text)
        text = document.text[start:end].strip()
        if text:
            pieces.append((text, location))
    return pieces


def _file_of(root: Path, document: Document) -> Path:
    """The file `document` was read from (a `.jsonl` record's source is `file:line`)."""
    if root.is_file():
        return root
    path = root / document.source
    if not path.is_file() and ":" in document.source:
        path = root / document.source.rsplit(":", 1)[0]
    return path


class HypicReader(BaseReader):
    """Loads files with hypic-rag's parsers into one LlamaIndex `Document` per page or section (see module doc)."""

    skipped: list[SkippedInput]

    def __init__(self) -> None:
        super().__init__()
        self.skipped = []

    def load_data(self, file: str | Path, extra_info: dict[str, Any] | None = None, **_: Any) -> list[LlamaDocument]:
        """Documents of `file` (a file or a folder); `extra_info` (what `SimpleDirectoryReader` knows of the file)
        is added to every document's metadata."""
        corpus = load_corpus(file)
        self.skipped = list(corpus.skipped)
        root = corpus.root
        documents = []
        for document in corpus.documents:
            path = _file_of(root, document)
            base = document.doc_id if root.is_dir() else f"{root}:{document.doc_id}"
            for number, (text, location) in enumerate(_pieces(document)):
                metadata: dict[str, Any] = {"file_name": path.name, "file_path": str(path), **(extra_info or {}),
                                            "doc_id": document.doc_id, "source": document.source, **document.metadata}
                if location is not None and location.page is not None:
                    metadata.update(page=location.page, page_label=str(location.page))
                if location is not None and location.section is not None:
                    metadata["section"] = location.section
                documents.append(LlamaDocument(
                    text=text, id_=f"{base}#{number}", metadata=metadata,
                    excluded_embed_metadata_keys=list(HIDDEN_METADATA_KEYS),
                    excluded_llm_metadata_keys=list(HIDDEN_METADATA_KEYS),
                ))
        return documents


def file_extractors(reader: HypicReader | None = None) -> dict[str, BaseReader]:
    """`SimpleDirectoryReader`'s `file_extractor`: every suffix hypic-rag reads, mapped to `reader` (a new
    `HypicReader` by default; its `skipped` lists the last file's unreadable parts)."""
    reader = reader if reader is not None else HypicReader()
    return {suffix: reader for suffix in sorted(CORPUS_SUFFIXES)}
