"""The peers benchmark (`hypic_rag/bench/peers.py`) refuses to start in one line when llama.cpp's pieces are
missing; the peer itself is an optional extra that `make test` never installs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hypic_rag.bench.peers import PeerMissingError, converter_script, require_llama_cpp


def test_missing_peer_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` meets when it is not installed
    with pytest.raises(PeerMissingError, match=r"llama-cpp-python is not installed: pip install -e '\.\[peers\]'"):
        require_llama_cpp()


def test_missing_converter_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(PeerMissingError, match="no convert_hf_to_gguf.py under"):
        converter_script(tmp_path)
    script = tmp_path / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    script.parent.mkdir(parents=True)
    script.write_text("")
    assert converter_script(tmp_path) == script


def test_command_without_the_converter_source_exits_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "hypic_rag.bench.peers", "--llama-cpp-source", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypic-rag peers: ") and "Traceback" not in done.stderr
