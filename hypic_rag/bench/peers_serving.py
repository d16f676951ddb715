"""Throughput side by side: llama.cpp's own server with parallel slots against the bare `hypic-rag serve`.

Both servers run in processes of their own on 127.0.0.1, on the same checkpoint (the peers benchmark's copy of the
timing model: its weights unchanged, a byte-level BPE tokenizer covering its whole vocabulary; `peers.py`), and
get the same prompts: k chunks of 256 tokens drawn from a shared pool, in a new order with a new question every
request (`ServedPrompt`). The chunk texts are two-letter words, each one token, so a chunk is exactly its number of
words in tokens.

- **llama-server** (built from the same llama.cpp source as llama-cpp-python, `scripts/build_llama_cpp.sh`), as
  its users start it: its own defaults plus `-t/-tb THREADS`, `-np 8` parallel slots, a context of 8 slots' prompts
  and `--cache-reuse 256` (its prompt cache is on by default); `POST /completion` with the prompt as token ids
  (the ids `hypic-rag serve` builds from the same text: `segmented_request`, the server's own cutting), greedy,
  streamed.
- **hypic-rag serve**: the bare command (`hypic-rag serve --index DIR --port P`) over an index of that checkpoint;
  `POST /v1/completions` with the chunks and the question separated by `<<PIC_SEP>>` (each chunk a segment,
  encoded once on first sight and reused in any order), greedy, streamed.

Before the cells: a warm-up (every pool chunk sent once to each server) and the correctness checks: llama-server's
greedy tokens on one unmeasured prompt, fed to this package's `full` mode in this process on the same ids (each must be
`full`'s own choice up to a near tie: `forced_gaps`), and the bare server's text on it against this package's
`hypic` generation in this process. Then the cells alternate
(llama-server 1 client, hypic-rag 1 client, llama-server `clients`, hypic-rag `clients`), closed loop, every
request a prompt neither server saw before; afterwards the first `clients` prompts of the concurrent cells are asked
again alone and compared with their concurrent answers (`mismatches`; llama-server may answer such a repeat from
its prompt cache).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hypic_rag.bench.batching import summarize
from hypic_rag.bench.measure import closed_loop
from hypic_rag.bench.server_clients import stop_server
from hypic_rag.bench.peers_common import LOGIT_TOLERANCE, NEW_TOKENS, THREADS, PeerMissingError

logger = logging.getLogger(__name__)

SLOTS = 8
"""llama-server's parallel slots (`-np`): one per concurrent client of the larger cell."""

CACHE_REUSE = 256
"""llama-server's `--cache-reuse` (the chunk size its prompt cache tries to reuse by shifting, as its docs suggest)."""

SEPARATOR = "<<PIC_SEP>>"
"""`hypic-rag serve`'s default segment separator."""


def require_llama_server(path: Path) -> Path:
    """`path` if it is an executable llama-server, else a one-line `PeerMissingError` saying how to build it."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PeerMissingError(f"no llama-server at {str(path)!r}: build it with scripts/build_llama_cpp.sh "
                               "(docs/benchmarks/peers.md)")
    return path


def llama_server_version(path: Path) -> str:
    """What `llama-server --version` prints (its build number and commit), one line."""
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0] if lines else "unknown"


@dataclass(frozen=True, slots=True)
class ServedPrompt:
    """One request's prompt both ways: `text` (segments joined by `SEPARATOR`, the question last) for hypic-rag
    serve, `ids` (the prompt's token ids as hypic-rag builds them from `text`) for llama-server, and the `request`
    those ids come from."""

    text: str
    ids: list[int]
    request: Any


def make_prompts(tokenizer: Any, count: int, top_k: int, chunk_tokens: int, pool_size: int, seed: int,
                 question_tokens: int = 24) -> tuple[list[str], list[ServedPrompt]]:
    """(the pool's chunk texts, `count` prompts): each prompt draws `top_k` chunks of the pool in a new order and
    a new question of `question_tokens` words. Words are two lowercase letters after a space: one token each with
    `peers.full_vocabulary_tokenizer`, so a chunk has exactly `chunk_tokens` tokens (checked)."""
    from hypic_rag.prompting.segments import segmented_request

    random = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def words(length: int) -> str:
        pairs = random.choice(letters, size=(length, 2))
        return "".join(" " + "".join(pair) for pair in pairs)

    pool = [words(chunk_tokens) for _ in range(pool_size)]
    prompts = []
    for _ in range(count):
        order = random.choice(pool_size, size=top_k, replace=False)
        segments = [pool[i] for i in order] + [words(question_tokens)]
        request = segmented_request(tokenizer, segments)
        if [len(ids) for ids in request.chunk_ids] != [chunk_tokens] * top_k:
            raise RuntimeError("the tokenizer does not give one token per word: not the peers tokenizer")
        prompts.append(ServedPrompt(SEPARATOR.join(segments), request.all_ids(), request))
    return pool, prompts


@contextmanager
def _process(command: list[str], ready_url: str, log_path: Path, environment: dict[str, str] | None = None,
             timeout_s: float = 900.0) -> Iterator[subprocess.Popen]:
    """`command` in a process of its own (output to `log_path`), once `ready_url` answers 200; SIGTERM at the end."""
    import httpx

    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(environment or {})})
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"{Path(command[0]).name} exited ({process.returncode}) before it was ready: "
                                       + " | ".join(tail))
                try:
                    if httpx.get(ready_url, timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{command[0]} was not ready within {timeout_s:g} s")
                time.sleep(0.3)
            yield process
        finally:
            stop_server(process)


def llama_server_command(binary: Path, gguf: Path, port: int, context_per_slot: int) -> list[str]:
    """llama-server as its users run it: its defaults plus the threads, `SLOTS` parallel slots, their context and
    `--cache-reuse`."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(THREADS),
            "-tb", str(THREADS), "-np", str(SLOTS), "-c", str(SLOTS * context_per_slot),
            "--cache-reuse", str(CACHE_REUSE)]


def hypic_serve_command(index: Path, port: int) -> list[str]:
    """The bare `hypic-rag serve` (only the index and the port)."""
    return [sys.executable, "-m", "hypic_rag", "serve", "--index", str(index), "--port", str(port)]


def _stream_events(http: Any, path: str, body: dict[str, Any], server: str) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-event answer to `POST path` (`data: {...}` lines); RuntimeError naming
    `server` on a status other than 200 or an error event."""
    with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server} answered {response.status_code}: {response.read()[:200]!r}")
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RuntimeError(f"{server}: {line}")
                yield event


def ask_llama_server(http: Any, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """llama-server's `/completion` on `ids`, greedy, streamed, at most `new_tokens` tokens (it stops at the end of
    sequence, id 0 of the peers tokenizer, as this package's generation does): (seconds to the first token,
    generated ids)."""
    body = {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "stream": True, "return_tokens": True}
    began = time.perf_counter()
    first = None
    tokens: list[int] = []
    for event in _stream_events(http, "/completion", body, "llama-server"):
        if event.get("tokens"):
            if first is None:
                first = time.perf_counter() - began
            tokens.extend(int(token) for token in event["tokens"])
        if event.get("stop"):
            break
    return (first if first is not None else time.perf_counter() - began), tokens


def ask_hypic_server(http: Any, text: str, new_tokens: int) -> tuple[float, int, str]:
    """hypic-rag's `/v1/completions` on `text`, greedy, streamed: (seconds to the first text, completion tokens,
    the text)."""
    body = {"prompt": text, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    first = None
    pieces: list[str] = []
    completion = 0
    for event in _stream_events(http, "/v1/completions", body, "hypic-rag serve"):
        for choice in event.get("choices", []):
            if choice.get("text"):
                if first is None:
                    first = time.perf_counter() - began
                pieces.append(choice["text"])
        if event.get("usage"):
            completion = int(event["usage"]["completion_tokens"])
    return (first if first is not None else time.perf_counter() - began), completion, "".join(pieces)


def build_index(checkpoint: Path, directory: Path) -> Path:
    """An index of `checkpoint` over a one-document corpus (the servers are sent their chunks in the prompts)."""
    from hypic_rag.pipeline.precompute import PrecomputeConfig, precompute

    corpus = directory / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "note.txt").write_text("a short note so that the index is not empty\n", encoding="utf-8")
    index = directory / "index"
    precompute(PrecomputeConfig(corpus=corpus, index_dir=index, model_path=checkpoint, device="cpu",
                                show_progress=False))
    return index


def _greedy_ids(engine: Any, request: Any, mode: str, new_tokens: int) -> list[int]:
    """This package's greedy generation of `new_tokens` tokens from `request` in `mode`, in this process."""
    from hypic_rag.runtime.sampling import SamplingParams

    with torch.no_grad():
        return list(engine.generate(request, mode, SamplingParams(max_new_tokens=new_tokens)).token_ids)


def forced_gaps(engine: Any, request: Any, tokens: list[int]) -> list[float]:
    """`full` mode fed `tokens` (another engine's greedy choices) after `request`: per step, how far the chosen
    token's logit lies below this package's largest logit there, as a fraction of the largest |logit| (0: the same
    choice). Near-flat logits of a random model make near ties, which F32 kernels summing in other orders may break
    either way; a gap within `peers_common.LOGIT_TOLERANCE` is such a tie, a larger one a different model or prompt."""
    gaps = []
    with torch.no_grad():
        prefilled = engine.prefill(request, "full")
        logits, state = prefilled.logits.float(), prefilled.state
        for number, token in enumerate(tokens):
            gaps.append(float((logits.max() - logits[token]) / logits.abs().max()))
            if number + 1 < len(tokens):
                logits, state = engine.decode_step(state, token)
                logits = logits.float()
    return gaps


def serving_throughput(model: Any, checkpoint: Path, gguf: Path, binary: Path, workdir: Path, *, clients: int = SLOTS,
                       top_k: int = 8, chunk_tokens: int = 256, pool_size: int = 24, one_client_requests: int = 4,
                       concurrent_requests: int = 16, max_seconds: float = 600.0, new_tokens: int = NEW_TOKENS,
                       seed: int = 0) -> dict[str, Any]:
    """The throughput rows (see the module docstring): model is this package's wrapped model of `checkpoint`
    (for the in-process checks), `gguf` its F32 GGUF, `binary` llama-server. max_seconds bounds each cell."""
    import httpx
    from transformers import AutoTokenizer

    from hypic_rag.prompting.segments import segmented_request
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.testing import free_port

    require_llama_server(binary)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    measured = one_client_requests + concurrent_requests
    pool, prompts = make_prompts(tokenizer, 1 + measured, top_k, chunk_tokens, pool_size, seed)
    check_prompt, cell_prompts = prompts[0], prompts[1:]
    index = build_index(checkpoint, workdir / "serving")
    context_per_slot = -(-(len(check_prompt.ids) + new_tokens + 64) // 256) * 256  # llama.cpp pads to 256
    llama_port, hypic_port = free_port(), free_port()
    result: dict[str, Any] = {
        "prompt": f"{top_k} x {chunk_tokens} from a pool of {pool_size}, new order and question per request",
        "prompt_tokens": len(check_prompt.ids), "new_tokens": new_tokens, "clients": clients,
        "llama_server": {"command": " ".join(llama_server_command(binary, gguf, llama_port, context_per_slot)),
                         "version": llama_server_version(binary)},
        "hypic_rag_serve": {"command": " ".join(hypic_serve_command(index, hypic_port))},
    }
    with (_process(llama_server_command(binary, gguf, llama_port, context_per_slot),
                   f"http://127.0.0.1:{llama_port}/health", workdir / "llama-server.log"),
          _process(hypic_serve_command(index, hypic_port), f"http://127.0.0.1:{hypic_port}/healthz",
                   workdir / "hypic-serve.log")):
        local = threading.local()

        def http(name: str) -> Any:
            if not hasattr(local, name):
                port = llama_port if name == "llama" else hypic_port
                setattr(local, name, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=1800))
            return getattr(local, name)

        try:
            result["hypic_rag_serve"]["healthz"] = http("hypic").get("/healthz").json()
        except (httpx.HTTPError, ValueError):
            pass
        # warm-up: every pool chunk once on each server (hypic-rag encodes and stores its entries)
        for start in range(0, pool_size, top_k):
            segments = pool[start:start + top_k] + [" warm up"]
            warm_text = SEPARATOR.join(segments)
            ask_llama_server(http("llama"), segmented_request(tokenizer, segments).all_ids(), 1)
            ask_hypic_server(http("hypic"), warm_text, 1)
        # correctness first: both servers against this package's in-process generation on the same ids
        engine = Engine(model)
        hypic_ids = _greedy_ids(engine, check_prompt.request, "hypic", new_tokens)
        _, llama_ids = ask_llama_server(http("llama"), check_prompt.ids, new_tokens)
        _, _, served_text = ask_hypic_server(http("hypic"), check_prompt.text, new_tokens)
        gaps = forced_gaps(engine, check_prompt.request, llama_ids)
        result["checks"] = {
            "llama_server_tokens": len(llama_ids),
            "llama_server_steps_full_would_choose": sum(gap == 0.0 for gap in gaps),
            "llama_server_largest_gap_to_full_choice": max(gaps),
            "llama_server_tokens_within_tolerance": all(gap <= LOGIT_TOLERANCE for gap in gaps),
            "tolerance": LOGIT_TOLERANCE,
            "hypic_serve_text_equals_in_process_hypic": served_text == tokenizer.decode(hypic_ids),
        }
        logger.info("serving checks: %s", result["checks"])

        answers: dict[str, dict[int, Any]] = {"llama": {}, "hypic": {}}
        lock = threading.Lock()

        def run_llama(number: int) -> tuple[float, int]:
            ttft, ids = ask_llama_server(http("llama"), cell_prompts[number].ids, new_tokens)
            with lock:
                answers["llama"][number] = ids
            return ttft, len(ids)

        def run_hypic(number: int) -> tuple[float, int]:
            ttft, count, text = ask_hypic_server(http("hypic"), cell_prompts[number].text, new_tokens)
            with lock:
                answers["hypic"][number] = text
            return ttft, count

        cells: dict[str, dict[str, Any]] = {}
        cell_plan = ((1, one_client_requests, 0), (clients, concurrent_requests, one_client_requests))
        for count, requests, first in cell_plan:
            for name, run_one in (("llama", run_llama), ("hypic", run_hypic)):  # the same prompts both ways
                loop = closed_loop(run_one, count, requests, max_seconds, first=first)
                cells[f"{name} {count}"] = summarize(count, [loop])
                logger.info("%s, %d client(s): %.3f requests/s", name, count,
                            cells[f"{name} {count}"]["requests_per_second"])
        # the concurrent answers against the same prompt asked alone
        # (llama-server answers such an exact repeat from a context checkpoint of the slot that held the prompt:
        # their TTFT is its exact-repeat reuse through the server, `repeat_ttft_p50`)
        mismatches = {"llama": 0, "hypic": 0}
        repeat_ttfts: dict[str, list[float]] = {"llama": [], "hypic": []}
        compared = 0
        for number in range(one_client_requests, one_client_requests + min(clients, concurrent_requests)):
            if number in answers["llama"] and number in answers["hypic"]:
                compared += 1
                ttft, ids = ask_llama_server(http("llama"), cell_prompts[number].ids, new_tokens)
                repeat_ttfts["llama"].append(ttft)
                mismatches["llama"] += ids != answers["llama"][number]
                ttft, _, text = ask_hypic_server(http("hypic"), cell_prompts[number].text, new_tokens)
                repeat_ttfts["hypic"].append(ttft)
                mismatches["hypic"] += text != answers["hypic"][number]
    log = (workdir / "llama-server.log").read_text(errors="replace").splitlines()
    result["llama_server"]["warnings"] = [line.split(" W ", 1)[1].strip() for line in log if " W " in line][:12]
    for name, label in (("llama", "llama_server"), ("hypic", "hypic_rag_serve")):
        one, many = cells[f"{name} 1"], cells[f"{name} {clients}"]
        result[label].update({
            "one_client": one, "concurrent": many,
            "requests_per_second_ratio": many["requests_per_second"] / one["requests_per_second"]
            if one["requests_per_second"] else float("nan"),
            "concurrent_answers_compared_alone": compared, "mismatches": mismatches[name],
            "repeat_ttft_p50": float(np.median(repeat_ttfts[name])) if repeat_ttfts[name] else float("nan"),
        })
    for key in ("one_client", "concurrent"):
        theirs = result["llama_server"][key]["requests_per_second"]
        result[f"hypic_vs_llama_server_requests_per_second_{key}"] = (
            result["hypic_rag_serve"][key]["requests_per_second"] / theirs if theirs else float("nan"))
    shutil.rmtree(workdir / "serving", ignore_errors=True)
    return result
