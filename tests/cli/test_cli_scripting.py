"""The CLI in scripts: `--version`, `ask --json`, `ask -` (question on standard input), and sources in score order
with the retrieval hop's finds marked and explained; real subprocesses over a real index on a tiny model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hypic_rag.cli.main import main
from kits.corpora import build_index, tiny_model_checkpoint

REPOSITORY = Path(__file__).resolve().parents[2]
DOCUMENTS = {
    "ada.md": "Ada Lind was born in 1970 in the town of Orrin. She works for Kestrel Works as a welder.",
    "kestrel.md": "Kestrel Works is a shipyard based in Tarrow, on the southern coast.",
    "bruno.md": "Bruno Hale was born in 1968 in Orrin. He works for the Amber Kiln studio as a potter.",
    "amber.md": "The Amber Kiln studio is based in Velm and fires its kilns twice a week.",
    "orrin.md": "The town of Orrin lies on the river Lune and is known for its welders and potters.",
    "lune.md": "The river Lune flows north from the Varn mountains to the sea at Orrin.",
}
HOP_QUESTION = "Where is the employer of Ada Lind based?"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("cli_scripting")
    model = tiny_model_checkpoint(work / "model", list(DOCUMENTS.values()) + [HOP_QUESTION])
    return build_index(work / "index", model, DOCUMENTS, chunk_tokens=48)


def run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m hypic_rag ARGV` in a subprocess, this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPOSITORY), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "hypic_rag", *argv], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, env=env, timeout=300, check=False)


def ask_args(index: Path, *extra: str) -> list[str]:
    return ["ask", "--index", str(index), "--max-new-tokens", "2", "--device", "cpu", *extra]


def test_version_prints_the_package_version() -> None:
    version = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]["version"]
    done = run("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"hypic-rag {version}\n", "")


def test_ask_reads_the_question_from_stdin_and_prints_one_json_object(index: Path) -> None:
    done = run(*ask_args(index, "--top-k", "3", "--json", "-"), stdin="  Where does Bruno Hale work?\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1  # one JSON object, one line
    data = json.loads(done.stdout)
    assert data["question"] == "Where does Bruno Hale work?"
    assert isinstance(data["answer"], str) and data["mode"] == "hypic" and data["finish_reason"]
    assert len(data["sources"]) == 3 and data["sources"][0]["doc_id"] == "bruno.md"
    for rank, source in enumerate(data["sources"], start=1):
        assert source["rank"] == rank and isinstance(source["hop"], bool)
        assert {"doc_id", "chunk_id", "score", "text", "source", "position", "metadata", "hop_query"} <= source.keys()
    assert data["usage"]["prompt_tokens"] > 0 and data["usage"]["cache_hits"] >= 1
    assert data["timings"]["time_to_first_token"] > 0 and data["timings"]["total"] > 0


@pytest.mark.parametrize("stdin", ["", "  \n\t\n"])
def test_ask_with_an_empty_stdin_is_one_clear_error(index: Path, stdin: str) -> None:
    done = run(*ask_args(index, "-"), stdin=stdin)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("hypic-rag ask: error: standard input is empty")


def test_sources_are_in_score_order_with_the_hop_marked_and_explained(
    index: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(ask_args(index, HOP_QUESTION, "--top-k", "3", "--hop-slots", "1", "--json")) == 0
    data = json.loads(capsys.readouterr().out)
    scores = [source["score"] for source in data["sources"]]
    assert scores == sorted(scores, reverse=True)
    hops = [source for source in data["sources"] if source["hop"]]
    assert [source["doc_id"] for source in hops] == ["kestrel.md"], data["sources"]
    assert "Kestrel Works" in hops[0]["hop_query"] and hops[0]["hop_score"] > hops[0]["score"]
    assert all(source["hop_query"] is None for source in data["sources"] if not source["hop"])

    assert main(ask_args(index, HOP_QUESTION, "--top-k", "3", "--hop-slots", "1")) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"^  \[(\d)\] (\S+) #\d+ \(score ([\d.]+)(, hop)?\)", out, flags=re.MULTILINE)
    assert [float(score) for _, _, score, _ in lines] == sorted((float(s) for _, _, s, _ in lines), reverse=True)
    assert [(doc, bool(hop)) for _, doc, _, hop in lines if hop] == [("kestrel.md", True)]
    rank = next(number for number, doc, _, _ in lines if doc == "kestrel.md")
    note = out.split(f"  [{rank}] kestrel.md", 1)[1].splitlines()[1]
    assert note.strip().startswith('hop: found by the follow-up query "') and "Kestrel Works" in note
    assert note.endswith("not by the question")
