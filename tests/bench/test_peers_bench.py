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


def test_missing_llama_server_is_one_line(tmp_path: Path) -> None:
    from hypic_rag.bench.peers_serving import require_llama_server

    with pytest.raises(PeerMissingError, match=r"no llama-server at .*: build it with scripts/build_llama_cpp\.sh"):
        require_llama_server(tmp_path / "llama-server")
    (tmp_path / "llama-server").write_text("")  # there, but not executable
    with pytest.raises(PeerMissingError, match="no llama-server at"):
        require_llama_server(tmp_path / "llama-server")


def test_checkpoint_tokenizer_covers_the_vocabulary_and_prompts_have_exact_lengths() -> None:
    """Every id of the model decodes to a distinct token, and the throughput prompts (two-letter words) give chunks
    of exactly their word count in tokens, the same ids the server's own cutting builds from the text."""
    from hypic_rag.bench.peers import full_vocabulary_tokenizer
    from hypic_rag.bench.peers_serving import SEPARATOR, make_prompts
    from hypic_rag.prompting.segments import segmented_request, split_segments

    tokenizer = full_vocabulary_tokenizer(4096)
    assert len(tokenizer) == 4096
    assert len({tokenizer.convert_ids_to_tokens(number) for number in range(4096)}) == 4096
    with pytest.raises(ValueError, match="at least 257"):
        full_vocabulary_tokenizer(100)
    pool, prompts = make_prompts(tokenizer, count=3, top_k=4, chunk_tokens=32, pool_size=6, seed=1, question_tokens=5)
    assert len(pool) == 6 and len(prompts) == 3
    for prompt in prompts:
        segments = split_segments(prompt.text, SEPARATOR)
        assert len(segments) == 5 and all(segment in pool for segment in segments[:4])
        assert segmented_request(tokenizer, segments).all_ids() == prompt.ids
        assert len(prompt.ids) == 4 * 32 + 5
    orders = {tuple(split_segments(prompt.text, SEPARATOR)[:4]) for prompt in prompts}
    assert len(orders) == 3  # a new draw and order per request


def test_throughput_table_names_both_servers_and_their_ratio() -> None:
    from hypic_rag.bench.peers import throughput_table

    def side(one: float, many: float) -> dict:
        return {"one_client": {"requests_per_second": one, "completed": 4, "ttft_p50": 1.0}, "repeat_ttft_p50": 0.5,
                "concurrent": {"requests_per_second": many, "completed": 16, "ttft_p50": 2.0},
                "requests_per_second_ratio": many / one, "concurrent_answers_compared_alone": 8, "mismatches": 1}

    row = {"clients": 8, "prompt": "8 x 256", "prompt_tokens": 2072, "new_tokens": 48,
           "llama_server": side(0.1, 0.08), "hypic_rag_serve": side(0.2, 0.5),
           "hypic_vs_llama_server_requests_per_second_one_client": 2.0,
           "hypic_vs_llama_server_requests_per_second_concurrent": 6.25,
           "checks": {"llama_server_tokens": 48, "llama_server_steps_full_would_choose": 45,
                      "llama_server_largest_gap_to_full_choice": 2e-4, "llama_server_tokens_within_tolerance": True,
                      "tolerance": 1e-3, "hypic_serve_text_equals_in_process_hypic": True}}
    text = "\n".join(throughput_table("medium", row))
    assert ("| llama-server F32 (`-np 8`, `--cache-reuse`) | 0.100 (4) | 0.080 (16) | 0.80x | 1.00 / 2.00 | 0.50 "
            "| 7 of 8 |") in text
    assert "| `hypic-rag serve` (bare command) | 0.200 (4) | 0.500 (16) | 2.50x | 1.00 / 2.00 | 0.50 | 7 of 8 |" in text
    assert "2.0x at 1 client, 6.2x at 8" in text and "`full`'s own choice at 45 steps and within 2.0e-04" in text


def test_forced_gaps_are_zero_on_full_own_choices_and_positive_elsewhere() -> None:
    """The llama-server check: tokens `full` chose itself have gap 0; another token has its logit's distance below
    the largest (relative), computed at the step it is fed."""
    import torch

    from hypic_rag.bench.peers_serving import _greedy_ids, forced_gaps
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.runtime.request import Request
    from hypic_rag.testing import build_tiny_model

    torch.manual_seed(0)
    engine = Engine(wrap_model(build_tiny_model("qwen3_5", seed=3)))
    ids = torch.randint(3, 200, (40,)).tolist()
    request = Request(ids[:4], [ids[4:20], ids[20:36]], ids[36:])
    chosen = _greedy_ids(engine, request, "full", 6)
    assert forced_gaps(engine, request, chosen) == [0.0] * 6
    with torch.no_grad():
        logits = engine.prefill(request, "full").logits.float()
    other = int(torch.argsort(logits, descending=True)[1])
    gaps = forced_gaps(engine, request, [other])
    assert gaps[0] > 0 and abs(gaps[0] - float((logits.max() - logits[other]) / logits.abs().max())) < 1e-6
