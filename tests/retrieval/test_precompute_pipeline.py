"""`hypic-rag precompute` and `hypic-rag ask` end to end on real files, a real tiny hybrid checkpoint, the shipped
embedder, real FAISS and the real segment cache: retrieval, incremental re-ingest, workers, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hypic_rag.cache.keys import CacheNamespace, segment_key
from hypic_rag.cache.lmdb_store import LmdbSegmentStore
from hypic_rag.cli.main import main
from hypic_rag.retrieval.corpus_index import CorpusIndex
from hypic_rag.retrieval.embeddings import default_embedder_path
from hypic_rag.retrieval.manifest import IndexManifest
from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute
from hypic_rag.testing import save_tiny_checkpoint

DOCUMENTS = {
    "harbor/lighthouse.md": (
        "The lighthouse of Kerran stands on the northern cliff above the harbor.\n\n"
        "The lighthouse of Kerran was built in 1821 by the engineer Ada Vell.\n\n"
        "The keeper of the Kerran lighthouse is Jonas Pell, who climbs its 212 steps every evening.\n"
    ),
    "town/bakery.txt": (
        "The Brindle bakery opens at five in the morning on Market Street.\n\n"
        "The Brindle bakery sells rye bread every Tuesday and honey cakes on Sundays.\n"
    ),
    "peaks.md": (
        "Mount Aster is the highest peak of the Varn range.\n\n"
        "The summit of Mount Aster is 4120 metres above sea level and covered in snow all year.\n"
    ),
    "trains.txt": (
        "The night train from Ostra to Velm leaves at 22:40 from platform nine.\n\n"
        "The journey from Ostra to Velm takes nine hours and the dining car serves beetroot soup.\n"
    ),
}
RECORDS = [
    {"id": "ferry", "text": "The ferry to Lune island departs from pier six at noon.", "kind": "timetable"},
    {"id": "museum", "text": "The Kerran museum shows maps drawn by Ada Vell.", "kind": "culture"},
]
CHUNK_TOKENS = 24


def write_corpus(root: Path) -> Path:
    for name, text in DOCUMENTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    lines = [json.dumps(RECORDS[0]), '{"id": "broken", "text": "unterminated', json.dumps(RECORDS[1])]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts = list(DOCUMENTS.values()) + [record["text"] for record in RECORDS]
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model"), texts * 4)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> dict[str, Path]:
    """One corpus precomputed once with the CLI; tests that change it work on copies."""
    work = tmp_path_factory.mktemp("built")
    corpus = write_corpus(work / "corpus")
    index = work / "index"
    code = main(["precompute", str(corpus), "--index", str(index), "--model", str(model_dir),
                 "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress"])
    assert code == 0
    return {"corpus": corpus, "index": index}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def options_for(corpus: Path, index: Path, model_dir: Path, **changes) -> PrecomputeConfig:
    values = dict(corpus=corpus, index_dir=index, model_path=model_dir, chunk_tokens=CHUNK_TOKENS, show_progress=False)
    values.update(changes)
    return PrecomputeConfig(**values)


def namespace_of(index: Path) -> CacheNamespace:
    manifest = IndexManifest.load(index)
    return CacheNamespace(manifest.model.fingerprint, manifest.model.tokenizer_fingerprint, manifest.seam_tokens)


def chunk_segments(index: Path) -> dict[str, tuple[int, ...]]:
    with CorpusIndex.open(index) as opened:
        return {chunk.chunk_id: chunk.token_ids for chunk in opened.docstore.iter_chunks()}


def cache_contents(index: Path) -> dict[bytes, bytes]:
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        return {key: bytes(store.get(key, touch=False)) for key in store.keys()}


def sources_of(output: str) -> list[str]:
    return re.findall(r"^\s+\[\d+\] (\S+) #\d+ \(score", output, flags=re.MULTILINE)


def test_precompute_indexes_and_caches_every_chunk(built: dict[str, Path]) -> None:
    index = built["index"]
    manifest = IndexManifest.load(index)
    segments = chunk_segments(index)
    assert manifest.counts["documents"] == 6 and manifest.counts["chunks"] == len(segments) >= 10
    assert all(len(ids) <= CHUNK_TOKENS for ids in segments.values())
    namespace = namespace_of(index)
    with LmdbSegmentStore.open(index / "segment_cache", readonly=True) as store:
        assert all(store.contains(segment_key(namespace, ids)) for ids in segments.values())
        assert store.counters().entries == len(set(segments.values())) + 1  # + the prompt prefix segment
    with CorpusIndex.open(index) as opened:
        assert sorted(opened.vectors.live_ids().tolist()) == opened.docstore.live_vector_ids().tolist()


def test_precompute_summary_and_skips(tmp_path: Path, model_dir: Path, capsys) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    code, out, err = run_cli(capsys, "precompute", str(corpus), "--index", str(tmp_path / "index"),
                             "--model", str(model_dir), "--chunk-tokens", str(CHUNK_TOKENS))
    assert code == 0
    assert "documents: 6 (6 added, 0 updated, 0 unchanged, 0 deleted)" in out
    assert re.search(r"^chunks: \d+ \(\d+ added, 0 removed\)$", out, flags=re.MULTILINE)
    assert re.search(r"^tokens: \d+$", out, flags=re.MULTILINE)
    assert "skipped: 1 inputs" in out and "records.jsonl:2: malformed JSON" in out
    encoded = re.search(r"^encoded: (\d+) of (\d+) segments, \d+ tokens in [\d.]+ s \((\d+) tokens/s\)$", out, re.M)
    assert encoded and encoded.group(1) == encoded.group(2) and int(encoded.group(3)) > 0
    assert re.search(r"^cache: [\d.]+ (KiB|MiB) in .*segment_cache$", out, flags=re.MULTILINE)
    assert re.search(r"^elapsed: [\d.]+ s", out, flags=re.MULTILINE)
    assert "encoding" in err and "tok/s" in err  # the progress bar

    code, out, _ = run_cli(capsys, "precompute", str(corpus), "--index", str(tmp_path / "index"),
                           "--model", str(model_dir), "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress")
    assert code == 0 and "encoded: 0 of" in out and "index is up to date" in out


def test_ask_retrieves_the_answer_chunk_from_the_cache(built: dict[str, Path], capsys) -> None:
    cases = {
        "Who is the keeper of the Kerran lighthouse?": "harbor/lighthouse.md",
        "How high is the summit of Mount Aster?": "peaks.md",
        "When does the night train to Velm leave?": "trains.txt",
        "Where does the ferry to Lune island depart from?": "ferry",
    }
    for question, document in cases.items():
        code, out, _ = run_cli(capsys, "ask", "--index", str(built["index"]), question, "--top-k", "3")
        assert code == 0, out
        assert document in sources_of(out), (question, out)
    assert out.startswith("Answer: ")
    timings = re.search(r"^Timings: (.*)$", out, flags=re.MULTILINE).group(1)
    for label in ("retrieval", "cache load", "compose", "prefill", "time to first token"):
        assert re.search(rf"{label} [\d.]+ ms", timings), label
    assert re.search(r"^Cache: 4 segments hit, 0 encoded", out, flags=re.MULTILINE)  # prefix + 3 chunks, all cached
    # without the retrieval hop the same chunk is found (the hop only takes the last place)
    code, out, _ = run_cli(capsys, "ask", "--index", str(built["index"]), "Where does the ferry to Lune island depart from?",
                           "--top-k", "3", "--hop-slots", "0")
    assert code == 0 and "ferry" in sources_of(out)


def test_reingest_edit_and_delete_encode_only_what_changed(built: dict[str, Path], tmp_path: Path, model_dir) -> None:
    corpus, index = tmp_path / "corpus", tmp_path / "index"
    shutil.copytree(built["corpus"], corpus)
    shutil.copytree(built["index"], index)
    before = chunk_segments(index)

    unchanged = precompute(options_for(corpus, index, model_dir))
    assert not unchanged.did_work and unchanged.ingest.documents_unchanged == 6
    assert (unchanged.ingest.chunks_added, unchanged.encode.encoded) == (0, 0)

    lighthouse = corpus / "harbor" / "lighthouse.md"
    lighthouse.write_text(lighthouse.read_text().replace("Jonas Pell", "Mira Stone"), encoding="utf-8")
    edited = precompute(options_for(corpus, index, model_dir))
    after = chunk_segments(index)
    new_segments = set(after.values()) - set(before.values())
    assert edited.ingest.documents_updated == 1 and edited.ingest.documents_unchanged == 5
    assert edited.encode.encoded == len(new_segments) == edited.ingest.chunks_added >= 1
    assert edited.encode.encoded < len(after) // 2
    assert {k: v for k, v in after.items() if k in before} == {k: before[k] for k in after if k in before}

    shutil.rmtree(corpus / "town")
    deleted = precompute(options_for(corpus, index, model_dir))
    assert deleted.ingest.documents_deleted == 1 and deleted.encode.encoded == 0
    with CorpusIndex.open(index) as opened:
        assert all(chunk.doc_id != "town/bakery.txt" for chunk in opened.docstore.iter_chunks())
        hits = opened.search("Which bakery sells rye bread?", k=50)
        assert hits and all(hit.chunk.doc_id != "town/bakery.txt" for hit in hits)
        assert sorted(opened.vectors.live_ids().tolist()) == opened.docstore.live_vector_ids().tolist()


def test_two_workers_produce_the_same_index_and_identical_cache_bytes(
    built: dict[str, Path], tmp_path: Path, model_dir: Path
) -> None:
    summary = precompute(options_for(built["corpus"], tmp_path / "index", model_dir, workers=2))
    assert summary.encode.encoded == summary.encode.segments > 10
    one, two = built["index"], tmp_path / "index"
    assert chunk_segments(two) == chunk_segments(one)
    with CorpusIndex.open(one) as first, CorpusIndex.open(two) as second:
        rows = lambda opened: [(c.vector_id, c.chunk_id, c.doc_id, c.text) for c in opened.docstore.iter_chunks()]  # noqa: E731
        assert rows(first) == rows(second)
        ids = first.docstore.live_vector_ids()
        assert (first.docstore.embeddings(ids) == second.docstore.embeddings(ids)).all()
        assert sorted(first.vectors.live_ids().tolist()) == sorted(second.vectors.live_ids().tolist())
    cached_one, cached_two = cache_contents(one), cache_contents(two)
    assert cached_one.keys() == cached_two.keys() and len(cached_one) == summary.encode.segments
    assert all(cached_one[key] == cached_two[key] for key in cached_one)


def test_bad_input_gives_one_clear_error(built: dict[str, Path], tmp_path: Path, model_dir: Path, capsys) -> None:
    index = str(built["index"])
    code, _, err = run_cli(capsys, "precompute", str(tmp_path / "missing"), "--index", str(tmp_path / "i"),
                           "--model", str(model_dir))
    assert code == 2 and err.strip().endswith("does not exist") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "i").exists()

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "image.txt").write_bytes(b"\x00\x01binary")
    code, _, err = run_cli(capsys, "precompute", str(tmp_path / "empty"), "--index", str(tmp_path / "i"),
                           "--model", str(model_dir))
    assert code == 2 and "holds no .txt, .md, .jsonl, .pdf, .html or .docx document" in err and "image.txt: binary file" in err

    code, _, err = run_cli(capsys, "precompute", str(built["corpus"]), "--index", str(tmp_path / "i"),
                           "--model", str(tmp_path / "no-model"))
    assert code == 2 and "no-model" in err and "config.json" in err

    code, _, err = run_cli(capsys, "precompute", str(built["corpus"]), "--index", index, "--model", str(model_dir),
                           "--chunk-tokens", "64", "--no-progress")
    assert code == 3 and "--chunk-tokens (24)" in err
    code, _, err = run_cli(capsys, "precompute", str(built["corpus"]), "--index", index, "--model", str(model_dir),
                           "--chunk-tokens", str(CHUNK_TOKENS), "--embedding-context", "none", "--no-progress")
    assert code == 3 and "embedding context 'document_head', not 'none'" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as exited:
        run_cli(capsys, "ask", "--index", index, "--neighbours", "sideways:1", "Where is the ferry?")
    assert exited.value.code == 2 and "argument --neighbours: neighbours must be one of" in capsys.readouterr().err

    other_model = save_tiny_checkpoint(tmp_path / "other-model", list(DOCUMENTS.values()), seed=1)
    code, _, err = run_cli(capsys, "precompute", str(built["corpus"]), "--index", index, "--model", str(other_model),
                           "--chunk-tokens", str(CHUNK_TOKENS), "--no-progress")
    assert code == 3 and "index was built for model" in err
    code, _, err = run_cli(capsys, "ask", "--index", index, "--model", str(other_model), "Where is the ferry?")
    assert code == 3 and "index was built for model" in err
    for flag, value, why in (("--hop-slots", "-1", "must be an integer in 0..256"), ("--top-k", "0", "must be an integer in 1..256")):
        with pytest.raises(SystemExit) as exited:  # argparse: usage line, then the error, exit 2
            run_cli(capsys, "ask", "--index", index, flag, value, "Where is the ferry?")
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"argument {flag}: {why}" in err.splitlines()[-1], err

    other_embedder = tmp_path / "other-embedder"
    shutil.copytree(default_embedder_path(), other_embedder, ignore=shutil.ignore_patterns("model.safetensors"))
    (other_embedder / "model.safetensors").symlink_to(default_embedder_path() / "model.safetensors")
    (other_embedder / "sentence_bert_config.json").write_text('{"max_seq_length": 128, "do_lower_case": false}')
    code, _, err = run_cli(capsys, "precompute", str(built["corpus"]), "--index", index, "--model", str(model_dir),
                           "--chunk-tokens", str(CHUNK_TOKENS), "--embedder", str(other_embedder), "--no-progress")
    assert code == 3 and "index was built with embedder all-MiniLM-L6-v2" in err
    code, _, err = run_cli(capsys, "ask", "--index", index, "--embedder", str(other_embedder), "Where is the ferry?")
    assert code == 3 and "embedder" in err

    code, _, err = run_cli(capsys, "ask", "--index", str(tmp_path / "no-index"), "Where is the ferry?")
    assert code == 2 and "holds no index" in err
    code, _, err = run_cli(capsys, "ask", "--index", index, "   ")
    assert code == 2 and "question is empty" in err
    for line in err.strip().splitlines():
        assert line.startswith("hypic-rag ask: error:")


def test_the_manifest_stores_the_whole_prompt_format_and_ask_composes_its_prefix(
    tmp_path: Path, model_dir: Path, capsys
) -> None:
    """The prefix decides the prefix segment's cache entry, so the manifest records the whole format and `ask`
    composes the prefix precompute encoded: every segment of the prompt is a hit. A manifest of the older layout
    (chunk template only) still reads, as that template with the default prefix and question template."""
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
    from hypic_rag.retrieval.errors import IndexMismatchError

    fmt = PromptFormat(prefix="Read the notes, then answer in a few words.\n", chunk_template="Note: {text}\n",
                       question_template="Q: {question}\nA:", answer_stop="\n")
    corpus, index = write_corpus(tmp_path / "corpus"), tmp_path / "index"
    precompute(options_for(corpus, index, model_dir, prompt_format=fmt))
    recorded = json.loads((index / "manifest.json").read_text(encoding="utf-8"))
    assert recorded["prompt_format"] == {"prefix": fmt.prefix, "chunk_template": fmt.chunk_template,
                                         "question_template": fmt.question_template, "answer_stop": "\n"}
    assert recorded["chunk_template"] == fmt.chunk_template  # still there for readers of the older layout
    assert IndexManifest.load(index).prompt_format == fmt

    question = "Who is the keeper of the Kerran lighthouse?"
    code, out, _ = run_cli(capsys, "ask", "--index", str(index), question, "--top-k", "3")
    assert code == 0, out
    assert re.search(r"^Cache: 4 segments hit, 0 encoded", out, flags=re.MULTILINE), out  # prefix + 3 chunks
    pipeline = RagPipeline.open(index, device="cpu")
    try:
        assert pipeline.prompt_format == fmt
        request = pipeline.request_for(question, [])
        assert request.prefix_ids == pipeline.session.tokenize_segment(fmt.prefix)
        assert request.question_ids == pipeline.session.tokenize_segment(fmt.question(question))
    finally:
        pipeline.close()

    with pytest.raises(IndexMismatchError, match="prompt format"):
        precompute(options_for(corpus, index, model_dir, prompt_format=PromptFormat(chunk_template=fmt.chunk_template)))

    del recorded["prompt_format"]  # the older layout
    (index / "manifest.json").write_text(json.dumps(recorded), encoding="utf-8")
    legacy = IndexManifest.load(index).prompt_format
    assert legacy == PromptFormat(chunk_template=fmt.chunk_template)
    assert (legacy.prefix, legacy.question_template) == (DEFAULT_PROMPT_FORMAT.prefix,
                                                         DEFAULT_PROMPT_FORMAT.question_template)
    code, out, _ = run_cli(capsys, "ask", "--index", str(index), question, "--top-k", "3")
    assert code == 0 and re.search(r"^Cache: 3 segments hit, 1 encoded", out, flags=re.MULTILINE), out
