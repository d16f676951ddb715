"""A LlamaIndex reader over hypic-rag's loader: PDF, HTML, DOCX, Markdown, text and `.jsonl`, with pages and sections.

    from hypic_rag.integrations.llama_index_reader import HypicReader
    documents = HypicReader().load_data("docs/")                   # a folder (recursive) or one file
    # or inside LlamaIndex's own reader: SimpleDirectoryReader("docs/", file_extractor={".pdf": HypicReader()})

Each page of a PDF and each section of an HTML, DOCX or Markdown file becomes one LlamaIndex `Document` whose
metadata holds `page` (and `page_label`, LlamaIndex's name for it) or `section` (the heading path, "Guide >
Setup"), with `doc_id`, `source` and the file's `title`; node parsers copy it into every node, so a query
engine's `source_nodes` say where each answer came from. Files that cannot be read are named in a warning (the
loader's) and listed in `reader.skipped`; a folder with nothing readable raises `EmptyCorpusError`.
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

from hypic_rag.retrieval.formats import Location
from hypic_rag.retrieval.loading import Document, SkippedInput, load_corpus


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


class HypicReader(BaseReader):
    """Loads files with hypic-rag's parsers into one LlamaIndex `Document` per page or section (see module doc)."""

    skipped: list[SkippedInput]

    def __init__(self) -> None:
        super().__init__()
        self.skipped = []

    def load_data(self, file: str | Path, extra_info: dict[str, Any] | None = None, **_: Any) -> list[LlamaDocument]:
        """Documents of `file` (a file or a folder); `extra_info` is added to every document's metadata."""
        corpus = load_corpus(file)
        self.skipped = list(corpus.skipped)
        documents = []
        for document in corpus.documents:
            for number, (text, location) in enumerate(_pieces(document)):
                metadata: dict[str, Any] = {**(extra_info or {}), "doc_id": document.doc_id,
                                            "source": document.source, **document.metadata}
                if location is not None and location.page is not None:
                    metadata.update(page=location.page, page_label=str(location.page))
                if location is not None and location.section is not None:
                    metadata["section"] = location.section
                documents.append(LlamaDocument(text=text, id_=f"{document.doc_id}#{number}", metadata=metadata))
        return documents
