"""Side by side with llama.cpp, what people run a hybrid model with on a CPU (an optional extra: `peers`).

The same checkpoint both ways: the random 174M `qwen3_5` timing model (`timing_model.py`, "medium") and the
bundled 2.2M default model, converted to GGUF (F32, and Q8_0, the quantised format users pick) by the converter
that llama.cpp ships with its source (`convert_hf_to_gguf.py`), then loaded by llama-cpp-python, run as its users
run it (`Llama(model_path, n_ctx, n_threads)`, its own defaults otherwise; `Llama.generate`, with its own prompt
reuse), never through this package's code.

The vocabulary: the converter needs a tokenizer it knows. The timing model has none, and the bundled model's
word-level tokenizer is not a byte-level BPE the converter recognises. Both sides are fed the same token ids
(llama.cpp never tokenizes here), so the GGUF only needs a valid vocabulary of the model's size: this module writes
a byte-level BPE tokenizer (trained on a few sentences; the converter pads the rest of the vocabulary with unused
`[PADn]` tokens) into the copied checkpoint, and answers the converter's pre-tokenizer check ("gpt-2") for that
tokenizer only, as the converter's own message asks (`get_vocab_base_pre`). The weights are converted unchanged.

Correctness before speed (`agreement`): llama.cpp's next-token logits on the same ids against this package's
`full` mode (largest |difference| at most `LOGIT_TOLERANCE` of the vector's largest |logit|: F32 on both sides,
different summation orders and kernels), and greedy tokens equal over 32 steps; the run refuses to report speed
when the F32 model disagrees.

Speed (`compare`): RAG prompts (prefix + k chunks from a shared pool in a new order + a new question), per request
and interleaved so machine noise weighs on every row alike: llama.cpp cold (its memory cleared), on an exact repeat
of a prompt it just answered, and on the same chunks reordered with a new question (its best reuse: its own
longest-common-prefix reuse); this package's `prefix`, `full` and `hypic` (warm entries); end-to-end seconds for
48 new tokens and decode tokens/s both ways. Medians are reported.

    python -m hypic_rag.bench.peers --llama-cpp-source DIR --json docs/benchmarks/peers.json

`--decode-only`: 8 x 256 only, and only the 48-token generations (llama.cpp cold, `hypic`) with their decode
tokens/s and hypic's ratio to each (`docs/benchmarks/peers_decode.json`).

DIR: the unpacked llama-cpp-python source distribution (it holds vendor/llama.cpp/convert_hf_to_gguf.py); see
docs/benchmarks/peers.md for the one command that installs the peer and fetches that source.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hypic_rag.bench.peers_common import LOGIT_TOLERANCE, NEW_TOKENS, THREADS, PeerMissingError

logger = logging.getLogger(__name__)

GREEDY_STEPS = 32
GGUF_TYPES = ("f32", "q8_0")

_CONVERT_WRAPPER = r"""
import sys
from pathlib import Path
script, tokenizer_dir = Path(sys.argv[1]), str(Path(sys.argv[2]).resolve())
sys.path.insert(0, str(script.parent / "gguf-py"))
sys.path.insert(0, str(script.parent))
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    # the byte-level BPE this benchmark wrote: llama.cpp never tokenizes text in the benchmark (ids are fed)
    if str(Path(getattr(tokenizer, "name_or_path", "")).resolve()) == tokenizer_dir:
        return "gpt-2"
    return known(self, tokenizer)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [str(script)] + sys.argv[3:]
import runpy
runpy.run_path(str(script), run_name="__main__")
"""


def require_llama_cpp() -> Any:
    """The `llama_cpp` module, or a one-line `PeerMissingError` saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise PeerMissingError("llama-cpp-python is not installed: pip install -e '.[peers]' (see "
                               "docs/benchmarks/peers.md; it builds llama.cpp from source)") from None
    return llama_cpp


def converter_script(source: Path) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` under `source` (the unpacked llama-cpp-python sdist, or a llama.cpp
    checkout), or a one-line `PeerMissingError`."""
    for candidate in (source / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py", source / "convert_hf_to_gguf.py"):
        if candidate.is_file():
            return candidate
    raise PeerMissingError(f"no convert_hf_to_gguf.py under {str(source)!r}: pass the unpacked llama-cpp-python "
                           "source (pip download --no-deps --no-binary :all: llama-cpp-python; tar xzf ...)")


def full_vocabulary_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens (at least 257), every id a distinct token: one
    special token (`<|endoftext|>`, id 0, the end of sequence: the only one, so that llama.cpp, which ends a
    generation at every special token it recognises, and this package stop at the same id), the 256 byte symbols,
    then merges of lowercase
    letters with and without a leading space (" a", "ab", " ab", "abc", " abc", ... as far as the size goes). Every id
    the model can emit thus decodes to text of its own, and `" " + two letters` is one token."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {token: number for number, token in enumerate(special + alphabet)}
    if vocab_size < len(vocab):
        raise ValueError(f"a byte-level vocabulary needs at least {len(vocab)} tokens, got {vocab_size}")
    merges: list[tuple[str, str]] = []
    space, letters = "\u0120", string.ascii_lowercase  # the byte-level symbol of a space
    pairs = [a + b for a in letters for b in letters]
    for left, rights in (([space], letters), (letters, letters), ([space + a for a in letters], letters),
                         (pairs, letters), ([space + pair for pair in pairs], letters)):
        for left_part in left:
            for right_part in rights:
                if len(vocab) < vocab_size and left_part + right_part not in vocab:
                    vocab[left_part + right_part] = len(vocab)
                    merges.append((left_part, right_part))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=special[0], pad_token=special[0])


def write_checkpoint(model: torch.nn.Module, directory: Path) -> Path:
    """`model`'s config and weights (unchanged) plus a byte-level BPE tokenizer of its vocabulary size
    (`full_vocabulary_tokenizer`), so that llama.cpp's converter accepts the directory and `hypic-rag serve` can
    serve it (see the module docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = full_vocabulary_tokenizer(int(model.config.get_text_config().vocab_size))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def convert(checkpoint: Path, script: Path, outfile: Path, outtype: str) -> tuple[Path, float]:
    """Run llama.cpp's converter on `checkpoint`: (the GGUF file, seconds)."""
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT_WRAPPER, str(script), str(checkpoint), str(checkpoint), "--no-mtp", "--outtype", outtype,
         "--outfile", str(outfile)],
        capture_output=True, text=True, env={**os.environ, "NO_LOCAL_GGUF": ""},
    )
    if done.returncode != 0 or not outfile.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"llama.cpp's converter failed ({outtype}): " + " | ".join(tail))
    return outfile, time.perf_counter() - began


def load_llama(path: Path, context_tokens: int) -> Any:
    """llama-cpp-python's `Llama` on `path`: its defaults plus the context size and `THREADS` threads."""
    llama_cpp = require_llama_cpp()
    return llama_cpp.Llama(model_path=str(path), n_ctx=context_tokens, n_threads=THREADS, n_threads_batch=THREADS,
                           verbose=False)


def llama_logits(llm: Any) -> torch.Tensor:
    """The next-token logits [vocab] after the last token `llm` evaluated (float32; llama.cpp's
    `llama_get_logits_ith(ctx, -1)`)."""
    llama_cpp = require_llama_cpp()
    pointer = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(llm.n_vocab(),)).copy())


def agreement(model: Any, llm: Any, request: Any, steps: int = GREEDY_STEPS) -> dict[str, Any]:
    """llama.cpp against `full` on `request`'s ids: the first logits' largest |difference| (absolute and as a
    fraction of full's largest |logit|) and the greedy tokens over `steps` (both sides feed their own choice)."""
    from hypic_rag.runtime.engine import Engine

    engine = Engine(model)
    ids = request.all_ids()
    with torch.no_grad():
        prefilled = engine.prefill(request, "full")
        ours = [prefilled.logits.float()]
        state = prefilled.state
        tokens_ours = [int(torch.argmax(ours[0]))]
        for _ in range(steps - 1):
            logits, state = engine.decode_step(state, tokens_ours[-1])
            tokens_ours.append(int(torch.argmax(logits)))
    llm.reset()
    llm.eval(ids)
    theirs = llama_logits(llm)
    tokens_theirs = [int(torch.argmax(theirs))]
    for _ in range(steps - 1):
        llm.eval([tokens_theirs[-1]])
        tokens_theirs.append(int(torch.argmax(llama_logits(llm))))
    difference = float((theirs - ours[0]).abs().max())
    scale = float(ours[0].abs().max())
    return {
        "prompt_tokens": len(ids),
        "max_abs_logit_difference": difference,
        "relative_to_largest_logit": difference / scale,
        "tolerance": LOGIT_TOLERANCE,
        "greedy_steps": steps,
        "greedy_equal_steps": next((i for i, (a, b) in enumerate(zip(tokens_ours, tokens_theirs)) if a != b), steps),
        "agrees": difference / scale <= LOGIT_TOLERANCE and tokens_ours == tokens_theirs,
    }


def llama_generate(llm: Any, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """`llm.generate` greedily from `ids` with its own prompt reuse: (seconds to the first token, seconds to
    `new_tokens` tokens; equal when new_tokens is 1)."""
    began = time.perf_counter()
    first = None
    for count, _ in enumerate(llm.generate(ids, temp=0.0, reset=True), start=1):
        if first is None:
            first = time.perf_counter() - began
        if count >= new_tokens:
            break
    return float(first), time.perf_counter() - began


@dataclass(frozen=True, slots=True)
class PromptShape:
    """k chunks of `chunk_tokens` from a pool of `pool_size`, `requests` measured requests."""

    top_k: int
    chunk_tokens: int
    pool_size: int
    requests: int

    @property
    def name(self) -> str:
        return f"k{self.top_k}x{self.chunk_tokens}"


def make_requests(shape: PromptShape, vocab: int, seed: int) -> tuple[list[Any], list[Any], list[Any]]:
    """(first, reordered, warm-up) requests: `first[i]` draws k chunks from the pool, `reordered[i]` has the same
    chunks in a new order with a new question; warm-up ones give prefix mode its checkpoints (other draws)."""
    from hypic_rag.runtime.request import Request

    random = np.random.default_rng(seed)

    def ids(length: int) -> list[int]:
        return random.integers(3, vocab, size=length).tolist()

    prefix = ids(16)
    pool = [ids(shape.chunk_tokens) for _ in range(shape.pool_size)]
    first, reordered, warmup = [], [], []
    for _ in range(shape.requests + 2):
        picked = random.choice(shape.pool_size, size=shape.top_k, replace=False)
        order = random.permutation(picked)
        while shape.top_k > 1 and order[0] == picked[0]:
            order = random.permutation(picked)
        made = (Request(prefix, [pool[i] for i in picked], ids(24)), Request(prefix, [pool[i] for i in order], ids(24)))
        if len(warmup) < 2:
            warmup.append(made[0])
        else:
            first.append(made[0])
            reordered.append(made[1])
    return first, reordered, warmup


def _ours_generate(engine: Any, request: Any, mode: str, new_tokens: int) -> tuple[float, float, int]:
    """(TTFT, end-to-end seconds, tokens) of this package's `mode` generating `new_tokens` greedily."""
    from hypic_rag.runtime.sampling import SamplingParams

    began = time.perf_counter()
    first: list[float] = []
    generation = engine.generate(request, mode, SamplingParams(max_new_tokens=new_tokens),
                                 on_token=lambda *_: first.append(time.perf_counter() - began) if not first else None)
    total = time.perf_counter() - began
    return (first[0] if first else total), total, len(generation.token_ids)


def compare(model: Any, llms: dict[str, Any], shape: PromptShape, seed: int, new_tokens: int = NEW_TOKENS,
            max_seconds: float = 900.0, decode_only: bool = False) -> dict[str, Any]:
    """The speed rows on `shape` (see the module docstring), every request's rows back to back. decode_only: only
    the rows of the 48-token generations (llama.cpp cold, `hypic`): end to end and decode tokens/s."""
    from hypic_rag.bench.measure import percentile, timed_prefill, warm_entries
    from hypic_rag.runtime.assembly import Assembly
    from hypic_rag.runtime.engine import Engine

    engine = Engine(model)
    first, reordered, warmup = make_requests(shape, model.config.vocab_size, seed)
    warm_entries(engine, [*first, *reordered, *warmup], {0, engine.seam_tokens}, show_progress=False)
    for request in warmup:
        engine.prefill(request, "prefix")
    samples: dict[str, list[float]] = {}

    def add(row: str, value: float) -> None:
        samples.setdefault(row, []).append(value)

    began = time.perf_counter()
    for number, (request, again) in enumerate(zip(first, reordered)):
        if time.perf_counter() - began > max_seconds:
            logger.warning("%s: time limit after %d requests", shape.name, number)
            break
        for name, llm in llms.items():
            llm.reset()  # cold: its memory cleared
            ttft, total = llama_generate(llm, request.all_ids(), new_tokens)
            add(f"llama.cpp {name} cold ttft", ttft)
            add(f"llama.cpp {name} e2e", total)
            add(f"llama.cpp {name} decode tok/s", (new_tokens - 1) / (total - ttft))
            if decode_only:
                continue
            add(f"llama.cpp {name} exact repeat ttft", llama_generate(llm, request.all_ids(), 1)[0])
            add(f"llama.cpp {name} reordered ttft", llama_generate(llm, again.all_ids(), 1)[0])
        with torch.no_grad():
            for mode in () if decode_only else ("prefix", "full"):
                add(f"{mode} ttft", timed_prefill(engine, again, Assembly(mode, engine.seam_tokens))[0])
            ttft, total, tokens = _ours_generate(engine, again, "hypic", new_tokens)
        add("hypic ttft", ttft)
        add("hypic e2e", total)
        add("hypic decode tok/s", (tokens - 1) / (total - ttft))
        logger.info("%s request %d: %s", shape.name, number,
                    ", ".join(f"{row} {values[-1]:.3f}" for row, values in samples.items()))
    medians = {row: percentile(values, 50) for row, values in samples.items()}
    result: dict[str, Any] = {
        "shape": shape.name, "requests": len(samples.get("hypic ttft", [])),
        "prompt_tokens": first[0].prompt_tokens, "new_tokens": new_tokens,
        "medians": medians, "samples": samples,
    }
    if "llama.cpp f32 reordered ttft" in medians:
        best = min(medians["llama.cpp f32 reordered ttft"], medians["llama.cpp f32 cold ttft"])
        result["hypic_ttft_speedup_vs_llama_cpp_f32_best_reuse_reordered"] = best / medians["hypic ttft"]
    for outtype in llms:
        if f"llama.cpp {outtype} decode tok/s" in medians and "hypic decode tok/s" in medians:
            result[f"hypic_decode_vs_llama_cpp_{outtype}"] = (
                medians["hypic decode tok/s"] / medians[f"llama.cpp {outtype} decode tok/s"])
    return result


def machine() -> dict[str, Any]:
    """The machine and the versions of both sides."""
    flags = ""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags")[1].split("\n")[0]
    except (OSError, IndexError):
        pass
    model_name = ""
    try:
        model_name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model_name or platform.processor(), "cores_available": len(os.sched_getaffinity(0)),
        "avx512": "avx512f" in flags, "amx": "amx_tile" in flags, "threads": THREADS,
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "llama_cpp_python": require_llama_cpp().__version__,
        "hypic_rag": importlib.metadata.version("hypic-rag"),
    }


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages (`/proc/loadavg`; empty where there is none)."""
    try:
        return [float(value) for value in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []


def run(source: Path, workdir: Path, shapes: list[PromptShape], seed: int = 0, max_seconds: float = 900.0,
        models: tuple[str, ...] = ("bundled", "medium"), decode_only: bool = False,
        llama_server: Path | None = None, serving: dict[str, Any] | None = None,
        convert_only: Path | None = None) -> dict[str, Any]:
    """Convert, check agreement, compare (see the module docstring); the result as a JSON-ready dict.
    llama_server: llama.cpp's server binary: on the timing model, the throughput rows at 1 and `SLOTS` clients
    against the bare `hypic-rag serve` (`peers_serving.serving_throughput`, keyword arguments `serving`), after the
    TTFT rows. convert_only: write the GGUF files (and the checkpoints they come from) into this directory and stop."""
    from hypic_rag.bench.timing_model import build_timing_model
    from hypic_rag.demo.default_model import default_model_path
    from hypic_rag.runtime.model import load_model, wrap_model

    require_llama_cpp()
    script = converter_script(source)
    torch.set_num_threads(THREADS)
    result: dict[str, Any] = {"machine": machine(), "load_average": {"start": load_average()}, "models": {}}
    longest = max(shape.top_k * shape.chunk_tokens for shape in shapes) + 16 + 24 + NEW_TOKENS + 8
    for name in models:
        if name == "bundled":
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
        else:
            hf_model = build_timing_model(name)
        target = convert_only if convert_only is not None else workdir
        checkpoint = write_checkpoint(hf_model, target / name)
        files, seconds = {}, {}
        for outtype in GGUF_TYPES:
            files[outtype], seconds[outtype] = convert(checkpoint, script, target / f"{name}-{outtype}.gguf", outtype)
            logger.info("%s %s: %s (%.1f s)", name, outtype, files[outtype], seconds[outtype])
        if convert_only is not None:
            result["models"][name] = {"conversion_seconds": seconds, "gguf": {k: str(v) for k, v in files.items()}}
            continue
        model = wrap_model(hf_model) if name != "bundled" else load_model(default_model_path(), device="cpu")
        context = min(longest, int(model.config.max_position_embeddings)) if name == "bundled" else longest
        llms = {outtype: load_llama(path, context) for outtype, path in files.items()}
        from hypic_rag.bench.workloads import TokenSource

        probe_tokens = TokenSource(int(model.config.vocab_size), seed + 7)
        from hypic_rag.runtime.request import Request

        probe = Request(probe_tokens.ids(16), [probe_tokens.ids(96) for _ in range(4)], probe_tokens.ids(24))
        checks = {outtype: agreement(model, llm, probe) for outtype, llm in llms.items()}
        entry: dict[str, Any] = {
            "parameters": sum(p.numel() for p in hf_model.parameters()),
            "conversion_seconds": seconds,
            "gguf_bytes": {outtype: path.stat().st_size for outtype, path in files.items()},
            "agreement": checks,
        }
        result["models"][name] = entry
        logger.info("%s: agreement %s", name, json.dumps(checks))
        if not checks["f32"]["agrees"]:
            entry["refused"] = "llama.cpp's F32 logits differ from full beyond the tolerance: no speed reported"
            logger.error("%s: %s", name, entry["refused"])
            continue
        if name == "bundled":  # checked for agreement; TTFT and decode are measured on the timing model
            if llama_server is not None:
                _throughput(entry, model, checkpoint, files["f32"], llama_server, workdir, seed, serving)
            continue
        entry["speed"] = []
        for index, shape in enumerate(shapes):
            began = load_average()
            speed = compare(model, llms, shape, seed + index, max_seconds=max_seconds, decode_only=decode_only)
            speed["load_average"] = {"start": began, "end": load_average()}
            entry["speed"].append(speed)
        del llms
        if llama_server is not None:
            _throughput(entry, model, checkpoint, files["f32"], llama_server, workdir, seed, serving)
    result["load_average"]["end"] = load_average()
    return result


def _throughput(entry: dict[str, Any], model: Any, checkpoint: Path, gguf: Path, llama_server: Path, workdir: Path,
                seed: int, serving: dict[str, Any] | None) -> None:
    """`entry["throughput"]`: `peers_serving.serving_throughput` with the load averages around it; a failure is
    logged and recorded as `entry["throughput_error"]` (the rows measured before it are kept)."""
    from hypic_rag.bench.peers_serving import serving_throughput

    began = load_average()
    try:
        entry["throughput"] = serving_throughput(model, checkpoint, gguf, llama_server, workdir, seed=seed,
                                                 **(serving or {}))
    except Exception as error:  # noqa: BLE001 - the run's other rows are still written
        logger.exception("throughput rows failed")
        entry["throughput_error"] = f"{type(error).__name__}: {error}"
        return
    entry["throughput"]["load_average"] = {"start": began, "end": load_average()}


ROWS = (
    ("llama.cpp f32 cold ttft", "llama.cpp F32, cold"),
    ("llama.cpp f32 exact repeat ttft", "llama.cpp F32, exact repeat of the prompt it just answered"),
    ("llama.cpp f32 reordered ttft", "llama.cpp F32, same chunks reordered + new question (its reuse)"),
    ("llama.cpp q8_0 cold ttft", "llama.cpp Q8_0, cold"),
    ("llama.cpp q8_0 exact repeat ttft", "llama.cpp Q8_0, exact repeat"),
    ("llama.cpp q8_0 reordered ttft", "llama.cpp Q8_0, same chunks reordered (its reuse)"),
    ("full ttft", "hypic-rag `full` (no reuse)"),
    ("prefix ttft", "hypic-rag `prefix` (exact-prefix checkpoints)"),
    ("hypic ttft", "hypic-rag `hypic` (warm entries)"),
)


def table(result: dict[str, Any]) -> str:
    """The markdown tables of a `run` result: TTFT medians per prompt shape, then end to end and decode."""
    lines: list[str] = []
    for name, entry in result["models"].items():
        for check_type, check in entry["agreement"].items():
            lines.append(f"- {name} {check_type.upper()}: largest |logit difference| {check['max_abs_logit_difference']:.2e} "
                         f"({check['relative_to_largest_logit']:.2e} of the largest |logit|), greedy tokens equal for "
                         f"{check['greedy_equal_steps']} of {check['greedy_steps']} steps")
    for name, entry in result["models"].items():
        for speed in entry.get("speed", []):
            medians = speed["medians"]
            lines += ["", f"**{name}, {speed['shape']}** ({speed['prompt_tokens']} prompt tokens, {speed['requests']} "
                      "requests, medians)", "", "| time to first token | seconds | hypic is faster by |", "|---|---|---|"]
            for key, label in ROWS if "hypic ttft" in medians else ():
                if key in medians:
                    lines.append(f"| {label} | {medians[key]:.3f} | {medians[key] / medians['hypic ttft']:.1f}x |")
            lines += ["", f"| {speed['new_tokens']} new tokens | end to end, s | decode tokens/s | hypic's decode / this |",
                      "|---|---|---|---|"]
            for label, prefix in (("llama.cpp F32 (cold)", "llama.cpp f32"), ("llama.cpp Q8_0 (cold)", "llama.cpp q8_0"),
                                  ("hypic-rag `hypic`", "hypic")):
                if f"{prefix} e2e" in medians:
                    rate = medians[f"{prefix} decode tok/s"]
                    lines.append(f"| {label} | {medians[f'{prefix} e2e']:.3f} | {rate:.1f} | "
                                 f"{medians['hypic decode tok/s'] / rate:.2f}x |")
    for name, entry in result["models"].items():
        if "throughput" in entry:
            lines += ["", *throughput_table(name, entry["throughput"])]
    return "\n".join(lines) + "\n"


def throughput_table(name: str, row: dict[str, Any]) -> list[str]:
    """The markdown lines of a `peers_serving.serving_throughput` result."""
    clients = row["clients"]
    lines = [f"**{name}, throughput** ({row['prompt']}, {row['prompt_tokens']} prompt tokens, {row['new_tokens']} new "
             "tokens, greedy, closed loop)", "",
             f"| server | 1 client, requests/s | {clients} clients, requests/s | {clients} / 1 | "
             f"TTFT p50, 1 / {clients} clients, s | exact repeat TTFT, s | concurrent answers equal to alone |",
             "|---|---|---|---|---|---|---|"]
    for key, label in (("llama_server", f"llama-server F32 (`-np {clients}`, `--cache-reuse`)"),
                       ("hypic_rag_serve", "`hypic-rag serve` (bare command)")):
        side = row[key]
        one, many = side["one_client"], side["concurrent"]
        lines.append(f"| {label} | {one['requests_per_second']:.3f} ({one['completed']}) | "
                     f"{many['requests_per_second']:.3f} ({many['completed']}) | "
                     f"{side['requests_per_second_ratio']:.2f}x | {one['ttft_p50']:.2f} / {many['ttft_p50']:.2f} | "
                     f"{side.get('repeat_ttft_p50', float('nan')):.2f} | "
                     f"{side['concurrent_answers_compared_alone'] - side['mismatches']} of "
                     f"{side['concurrent_answers_compared_alone']} |")
    checks = row["checks"]
    ratio_one = row["hypic_vs_llama_server_requests_per_second_one_client"]
    lines += ["", f"hypic-rag serve over llama-server, requests/s: {ratio_one:.1f}x "
              f"at 1 client, {row['hypic_vs_llama_server_requests_per_second_concurrent']:.1f}x at {clients}. Checks: "
              f"each of llama-server's {checks['llama_server_tokens']} greedy tokens, fed to `full` in this process, is "
              f"`full`'s own choice at {checks['llama_server_steps_full_would_choose']} steps and within "
              f"{checks['llama_server_largest_gap_to_full_choice']:.1e} of its largest logit at every step (tolerance "
              f"{checks['tolerance']:.0e}: {'met' if checks['llama_server_tokens_within_tolerance'] else 'NOT met'}); "
              "the bare "
              f"server's text {'equals' if checks['hypic_serve_text_equals_in_process_hypic'] else 'differs from'} "
              "`hypic`'s in this process."]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Bar charts: the TTFT medians of every shape (log scale, seconds written beside each bar), and the
    throughput rows (requests/s at 1 and at 8 clients, both servers) where the run has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    speeds = [(name, speed) for name, entry in result["models"].items() for speed in entry.get("speed", [])]
    rows = [(name, entry["throughput"]) for name, entry in result["models"].items() if "throughput" in entry]
    panels = max(1, len(speeds) + len(rows))
    figure, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8), squeeze=False)
    for axis, (name, speed) in zip(axes[0], speeds):
        bars = [(label, speed["medians"][key]) for key, label in ROWS if key in speed["medians"]]
        labels = [label.replace("hypic-rag ", "").replace("`", "").replace(" of the prompt it just answered", "")
                  .replace("same chunks reordered + new question (its reuse)", "reordered (its reuse)")
                  .replace("same chunks reordered (its reuse)", "reordered (its reuse)") for label, _ in bars]
        values = [value for _, value in bars]
        axis.barh(labels, values, color=["#c44" if label.startswith("llama") else "#48c" for label in labels])
        for number, value in enumerate(values):
            axis.text(value * 1.05, number, f"{value:.2f} s", va="center", fontsize=8)
        axis.set_xscale("log")
        axis.set_xlim(min(values) / 2, max(values) * 4)
        axis.xaxis.set_major_locator(LogLocator(base=10))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_xlabel("time to first token, s (median, log scale)")
        axis.set_title(f"{name} model, {speed['shape']}, {result['machine']['threads']} threads", fontsize=10)
        axis.invert_yaxis()
    for axis, (name, row) in zip(axes[0][len(speeds):], rows):
        clients = row["clients"]
        servers = (("llama_server", "llama-server F32", "#c44"), ("hypic_rag_serve", "hypic-rag serve", "#48c"))
        for number, (key, label, color) in enumerate(servers):
            values = [row[key]["one_client"]["requests_per_second"], row[key]["concurrent"]["requests_per_second"]]
            places = [place + (number - 0.5) * 0.38 for place in range(2)]
            axis.bar(places, values, width=0.36, color=color, label=label)
            for place, value in zip(places, values):
                axis.text(place, value, f"{value:.3f}", ha="center", va="bottom", fontsize=8)
        axis.set_xticks([0, 1], ["1 client", f"{clients} clients"])
        axis.set_ylabel("requests/s (48 new tokens)")
        axis.set_title(f"{name} model, throughput, {row['prompt_tokens']}-token RAG prompts", fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp-source", type=Path, required=True, metavar="DIR",
                        help="the unpacked llama-cpp-python source (holds vendor/llama.cpp/convert_hf_to_gguf.py)")
    parser.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                        help="llama.cpp's llama-server built from that source (scripts/build_llama_cpp.sh): adds the "
                             "throughput rows (1 and 8 clients) against the bare `hypic-rag serve`")
    parser.add_argument("--requests", type=int, default=5, help="measured requests at 8 x 256")
    parser.add_argument("--long-requests", type=int, default=2, help="measured requests at 16 x 512 (0: none)")
    parser.add_argument("--seconds", type=float, default=900.0, help="wall-time bound per prompt shape")
    parser.add_argument("--serving-requests", type=int, default=16,
                        help="requests of the 8-client throughput cells (the 1-client cells: a quarter, at least 2)")
    parser.add_argument("--models", default="bundled,medium", help="comma-separated: bundled, medium")
    parser.add_argument("--decode-only", action="store_true",
                        help="8 x 256 only, and only the 48-token generations (decode tokens/s both ways)")
    parser.add_argument("--convert-only", type=Path, default=None, metavar="DIR",
                        help="only write the checkpoints and their GGUF files (F32, Q8_0) into DIR")
    parser.add_argument("--note", default="", help="a line recorded in the JSON (e.g. which branches were merged)")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        require_llama_cpp()
        converter_script(options.llama_cpp_source)
        if options.llama_server is not None:
            from hypic_rag.bench.peers_serving import require_llama_server

            require_llama_server(options.llama_server)
    except PeerMissingError as error:
        print(f"hypic-rag peers: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None
    shapes = [PromptShape(8, 256, 24, options.requests)]
    if not options.decode_only and options.long_requests > 0:
        shapes.append(PromptShape(16, 512, 16, options.long_requests))
    serving = {"concurrent_requests": options.serving_requests,
               "one_client_requests": max(2, options.serving_requests // 4)}
    if options.convert_only is not None:
        options.convert_only.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hypic-peers-") as directory:
        result = run(options.llama_cpp_source, Path(directory), shapes, max_seconds=options.seconds,
                     models=tuple(options.models.split(",")), decode_only=options.decode_only,
                     llama_server=None if options.decode_only else options.llama_server, serving=serving,
                     convert_only=options.convert_only)
    result["command"] = "python -m hypic_rag.bench.peers " + " ".join(sys.argv[1:])
    if options.note:
        result["note"] = options.note
    text = json.dumps(result, indent=2)
    if options.convert_only is not None:
        print(text)
        return
    if options.json is not None:
        options.json.write_text(text + "\n", encoding="utf-8")
        if not options.decode_only:  # the plot shows TTFT rows, which a decode-only run has not
            plot(result, options.json.with_suffix(".png"))
    print(table(result))


if __name__ == "__main__":
    main()
