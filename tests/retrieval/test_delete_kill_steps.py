"""A process killed (SIGKILL, a real subprocess) at each step of deleting a document leaves an index the next writer
makes whole on disk: the docstore and `vectors.faiss` hold the same chunks and the manifest counts them, with the
document either wholly there (killed before the docstore committed) or wholly gone. Before, a writer reopening the
index repaired FAISS in memory only, and `vectors.faiss` kept the deleted document's vectors on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
from hypic_rag.retrieval.corpus_index import DOCSTORE_FILE, VECTORS_FILE, CorpusIndex, IndexConfig
from hypic_rag.retrieval.docstore import DocStore
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.faiss_index import VectorIndex
from hypic_rag.retrieval.loading import load_corpus
from hypic_rag.retrieval.manifest import IndexManifest, ModelIdentity
from hypic_rag.testing import train_tiny_tokenizer
from kits.corpora import SMALL_CORPUS, write_corpus

ROOT = Path(__file__).resolve().parents[2]
DELETED = "lavender.md"

OPEN_WRITER = '''
from pathlib import Path

from hypic_rag.retrieval.chunking import ChunkerConfig
from hypic_rag.retrieval.corpus_index import CorpusIndex, IndexConfig
from hypic_rag.retrieval.embeddings import SentenceEmbedder
from hypic_rag.retrieval.manifest import IndexManifest


def open_writer(directory):
    """The index opened for update with the settings its manifest records (as `serve` opens it)."""
    manifest = IndexManifest.load(Path(directory))
    settings = IndexConfig(model=manifest.model, chunker=ChunkerConfig(
        chunk_tokens=manifest.chunker["chunk_tokens"], paragraph_fill=manifest.chunker["paragraph_fill"]),
                             prompt_format=manifest.prompt_format, seam_tokens=manifest.seam_tokens)
    return CorpusIndex.open_for_update(directory, SentenceEmbedder(), settings)
'''

KILL_AT = {  # step -> the code that makes the child kill itself there (then it deletes DELETED)
    "inside the docstore transaction": '''
        from hypic_rag.retrieval import docstore
        original = docstore._Transaction.__exit__
        def exit_(self, *info):
            self._db.execute("SELECT 1")  # the DELETEs ran; COMMIT never does
            die()
        docstore._Transaction.__exit__ = exit_
    ''',
    "after the docstore commit": '''
        from hypic_rag.retrieval.docstore import DocStore
        original = DocStore.delete_document
        DocStore.delete_document = lambda self, doc_id: (original(self, doc_id), die())
    ''',
    "with the new FAISS file written, not renamed": '''
        import os
        original = os.replace
        os.replace = lambda source, target: die() if str(target).endswith("vectors.faiss") else original(source, target)
    ''',
    "after the FAISS file, before the manifest": '''
        from hypic_rag.retrieval.faiss_index import VectorIndex
        original = VectorIndex.save
        VectorIndex.save = lambda self, path: (original(self, path), die())
    ''',
    "after the manifest": '''
        from hypic_rag.retrieval.manifest import IndexManifest
        original = IndexManifest.save
        IndexManifest.save = lambda self, directory: (original(self, directory), die())
    ''',
}


def child_script(directory: Path, step: str) -> str:
    return "\n".join([
        "import os, signal",
        OPEN_WRITER,
        "def die():\n    os.kill(os.getpid(), signal.SIGKILL)",
        textwrap.dedent(KILL_AT[step]),
        f"index = open_writer({str(directory)!r})",
        f"index.delete_document({DELETED!r})",
        "raise SystemExit('the kill did not happen')",
    ])


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("delete_kills")
    corpus = write_corpus(base / "corpus", {name: text * 3 for name, text in SMALL_CORPUS.items()})
    chunker = Chunker(train_tiny_tokenizer(list(SMALL_CORPUS.values()) * 3), ChunkerConfig(chunk_tokens=32))
    settings = IndexConfig(model=ModelIdentity(path="tiny", fingerprint="m", tokenizer_fingerprint="t"),
                             chunker=ChunkerConfig(chunk_tokens=32))
    with CorpusIndex.open_for_update(base / "index", SentenceEmbedder(), settings) as index:
        index.ingest(load_corpus(corpus), chunker)
    return base / "index"


def on_disk(directory: Path) -> tuple[set[int], set[int], dict[str, int], dict[str, int], int]:
    """What the files say, read without opening the index (no repair): the docstore's live vector ids, the FAISS
    file's ids, the manifest's counts, the docstore's counts, and the chunks of the deleted document."""
    manifest = IndexManifest.load(directory)
    store = DocStore(directory / DOCSTORE_FILE)
    try:
        live = set(store.live_vector_ids().tolist())
        counts = store.counts()
        deleted = sum(1 for chunk in store.iter_chunks() if chunk.doc_id == DELETED)
    finally:
        store.close()
    stored = set(VectorIndex.load(directory / VECTORS_FILE, manifest.embedder.dimension,
                                  manifest.vector_index).stored_ids().tolist())
    return live, stored, manifest.counts, {"documents": counts.documents, "chunks": counts.chunks,
                                           "tokens": counts.tokens}, deleted


@pytest.mark.parametrize("step", list(KILL_AT))
def test_a_kill_at_each_step_of_a_delete_leaves_files_the_next_writer_makes_agree(built: Path, tmp_path: Path,
                                                                                  step: str) -> None:
    directory = Path(shutil.copytree(built, tmp_path / "index"))
    before = on_disk(directory)
    assert before[0] == before[1] and before[4] > 0
    environment = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
    killed = subprocess.run([sys.executable, "-c", child_script(directory, step)], capture_output=True, text=True,
                            timeout=180, env=environment)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    exec(OPEN_WRITER, namespace := {})  # the next writer (a restarted server, a precompute) opens and closes it
    namespace["open_writer"](directory).close()

    live, stored, recorded, counted, deleted = on_disk(directory)
    assert stored == live, f"{len(stored)} vectors in {VECTORS_FILE}, {len(live)} chunks in the docstore"
    assert recorded == counted
    committed = step != "inside the docstore transaction"
    assert deleted == (0 if committed else before[4])
    assert len(live) == len(before[0]) - (before[4] if committed else 0)
    with CorpusIndex.open(directory, SentenceEmbedder()) as reader:  # a reader finds nothing left to repair
        assert set(reader.vectors.live_ids().tolist()) == live
    assert json.loads((directory / "manifest.json").read_text())["counts"]["chunks"] == len(live)
