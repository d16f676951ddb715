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


def test_table_of_a_decode_only_run_puts_each_ratio_beside_its_row() -> None:
    """A decode-only result (`compare(..., decode_only=True)` rows: cold llama.cpp and `hypic`, no reuse rows)
    renders every decode rate with hypic's decode over it, and no TTFT row it does not have."""
    from hypic_rag.bench.peers import table

    check = {"max_abs_logit_difference": 1e-3, "relative_to_largest_logit": 1e-4, "greedy_equal_steps": 32,
             "greedy_steps": 32}
    medians = {"llama.cpp f32 cold ttft": 10.0, "llama.cpp f32 e2e": 13.0, "llama.cpp f32 decode tok/s": 16.0,
               "llama.cpp q8_0 cold ttft": 9.0, "llama.cpp q8_0 e2e": 11.0, "llama.cpp q8_0 decode tok/s": 32.0,
               "hypic ttft": 0.5, "hypic e2e": 4.0, "hypic decode tok/s": 12.0}
    result = {"models": {"medium": {"agreement": {"f32": check},
                                    "speed": [{"shape": "k8x256", "prompt_tokens": 2088, "requests": 5,
                                               "new_tokens": 48, "medians": medians}]}}}
    text = table(result)
    assert "| llama.cpp F32 (cold) | 13.000 | 16.0 | 0.75x |" in text
    assert "| llama.cpp Q8_0 (cold) | 11.000 | 32.0 | 0.38x |" in text
    assert "| hypic-rag `hypic` | 4.000 | 12.0 | 1.00x |" in text
    assert "| llama.cpp F32, cold | 10.000 | 20.0x |" in text and "reordered" not in text
