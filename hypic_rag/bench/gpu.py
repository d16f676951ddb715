"""The GPU benchmark: one random ~2B model per mixer kind (`gpu_models.GPU_MODELS`) in bf16, each measured for
- time to first token of transformers' own forward and of the runtime's `full`, `transition_rope` and `hypic`
  (seam 8) at k = 16 x 512 and 8 x 256 chunk tokens (plus a 64-token prefix and a 32-token question), the entries
  warm: held in host memory as the engine keeps them (copied per request) and resident on the GPU
  (`... (resident)`, as the HYPIC paper keeps its cache);
- encoding throughput (16 chunks of 512 tokens into entries, against transformers' forward over the same batch);
- batched throughput at 8 clients: the `Scheduler` serving a closed loop of 8 clients (RAG k = 8 x 256, warm,
  `hypic`, 32-token answers), batched against one request at a time (`bench.batching.engine_throughput`);
- the kernels one call each: composing 16 cached maps of the model's transition kind, carrying conv tails over 16
  spans of 8 sequences, and re-positioning a chunk's keys (Triton against torch, through the runtime's dispatches).
Each TTFT is the median of `repeats` runs after an untimed warm-up (which encodes the entries and compiles the
kernels; a transformers warm-up slower than 3 s counts as a run). The whole run keeps to `--budget-seconds`: a
measurement is skipped once the budget is spent (and says so), a family that fails records its error and the next
one runs, and the JSON / markdown are rewritten after every measurement, so a run cut short keeps its numbers.

    PYTHONPATH=. python3 -m hypic_rag.bench.gpu --output DIR     # DIR/gpu_bench.json and DIR/gpu_bench.md

`--size tiny --device cpu --dtype float32` runs the same code in seconds on CPU with the test suite's tiny models
(tests/bench/test_gpu_bench.py does, so the GPU run does not break where nobody can fix it).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hypic_rag.bench.gpu_models import GPU_MODELS, MIXER_KINDS, build_gpu_model

logger = logging.getLogger(__name__)

SLOW_WARMUP_SECONDS = 3.0
"""A transformers warm-up slower than this is a run of its own (its compile time is noise next to it)."""

TARGETS = {"hypic_vs_transformers": {"gated_deltanet": 20.0, "other": 10.0}, "hypic_over_transition_rope": 1.3,
           "batched_over_one": 5.0}
"""The GPU path's targets at the largest prompt: hypic TTFT that many times lower than transformers' forward, at most
1.3x transition_rope's, and 8 batched clients' tokens/s that many times one at a time's."""


class Budget:
    """Wall-clock budget of the whole run: what is left, and whether a measurement may start."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allows(self, what: str) -> bool:
        if self.left() > 0:
            return True
        logger.warning("time budget spent: %s skipped", what)
        return False


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(run: Callable[[], Any], device: torch.device, repeats: int, setup: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of `repeats` calls of `run` after one untimed warm-up, each ending on a device synchronisation;
    `setup` (untimed) runs before every call."""
    seconds = []
    for number in range(repeats + 1):
        if setup is not None:
            setup()
        _synchronize(device)
        began = time.perf_counter()
        run()
        _synchronize(device)
        if number:
            seconds.append(time.perf_counter() - began)
    return seconds


def measure_ttft(run: Callable[[], float], repeats: int, cap_seconds: float, *, slow_warmup_counts: bool) -> dict[str, Any]:
    """Median of up to `repeats` calls of `run` (each returns its own seconds, synchronised) after a warm-up call;
    no new call starts past `cap_seconds` (one always runs)."""
    warmup = run()
    seconds = [warmup] if slow_warmup_counts and warmup > SLOW_WARMUP_SECONDS else []
    began = time.perf_counter()
    while len(seconds) < repeats and (not seconds or time.perf_counter() - began < cap_seconds):
        seconds.append(run())
    return {"seconds": statistics.median(seconds), "runs": len(seconds), "warmup_seconds": warmup}


def _resident_engine(model, seam_tokens: int):
    """An engine whose encoded entries stay on the model's device (a cache in GPU memory)."""
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.get_or_encode import SegmentEntries, on_device

    class ResidentEntries(SegmentEntries):
        def encode(self, segments, seam_tokens, *, check=None):
            device = self.model.device
            return [on_device(entry, device) for entry in super().encode(segments, seam_tokens, check=check)]

    engine = Engine(model, seam_tokens=seam_tokens, memory_cache_bytes=64 << 30)
    entries = engine.entries
    engine.entries = ResidentEntries(engine.model, entries.source, batch_tokens=entries.batch_tokens,
                                     miss_encoder=entries.miss_encoder)
    return engine


STAT_NAMES = ("recomputed_tokens", "cached_tokens", "cache_bytes_loaded")
ENGINE_MODES = ("full", "transition_rope", "hypic", "transition_rope (resident)", "hypic (resident)")


def bench_ttft(model, request, *, seam_tokens: int, repeats: int, budget: Budget, cap_seconds: float,
               on_measurement: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """One prompt's TTFT under transformers' forward and each engine mode (see the module docstring); the row so
    far goes to `on_measurement` after every mode."""
    from hypic_rag.bench.measure import timed_prefill, timed_transformers_forward
    from hypic_rag.runtime.assembly import Assembly
    from hypic_rag.runtime.engine import Engine

    row: dict[str, Any] = {"prompt_tokens": request.prompt_tokens, "ttft_seconds": {}, "runs": {}, "stats": {},
                           "skipped": [], "errors": {}}
    engines = {
        "": Engine(model, seam_tokens=seam_tokens, memory_cache_bytes=64 << 30),
        " (resident)": _resident_engine(model, seam_tokens),
    }
    for label in ("transformers", *ENGINE_MODES):
        if not budget.allows(f"{label} at {request.prompt_tokens} tokens"):
            row["skipped"].append(label)
            continue
        cap = max(1.0, min(cap_seconds, budget.left()))
        stats: dict[str, Any] = {}
        try:
            if label == "transformers":
                measured = measure_ttft(lambda: timed_transformers_forward(model, request)[0], repeats, cap,
                                        slow_warmup_counts=True)
            else:
                mode, _, resident = label.partition(" ")
                engine = engines[" " + resident if resident else ""]

                def prefill(engine=engine, mode=mode, stats=stats) -> float:
                    seconds, _, result_stats = timed_prefill(engine, request, Assembly(mode, seam_tokens))
                    stats.update(result_stats.as_dict())
                    return seconds

                measured = measure_ttft(prefill, repeats, cap, slow_warmup_counts=False)  # the warm-up encodes
                row["stats"][label] = {name: stats.get(name) for name in STAT_NAMES}
        except Exception as error:  # the other modes still get measured
            logger.exception("%s at %d tokens failed", label, request.prompt_tokens)
            row["errors"][label] = f"{type(error).__name__}: {error}"
        else:
            row["ttft_seconds"][label] = measured["seconds"]
            row["runs"][label] = measured["runs"]
        on_measurement(row)
    baseline = row["ttft_seconds"].get("transformers")
    row["speedup_vs_transformers"] = {
        label: baseline / value for label, value in row["ttft_seconds"].items() if baseline is not None
    }
    for engine in engines.values():
        engine.segment_source.close()
    return row


def bench_kernels(model, *, maps: int, chunk_tokens: int, repeats: int) -> dict[str, Any]:
    """Microseconds per call through the runtime's own dispatches with each backend (torch, and Triton where the
    switch enables it): composing `maps` cached maps of the model's transition kind onto one state, carrying the
    conv tails of 8 sequences over 16 spans each, and re-positioning one chunk's keys into a K buffer."""
    from hypic_rag.runtime.mixers.attention import RotaryPositions
    from hypic_rag.runtime.ops import backends
    from hypic_rag.runtime.ops.compose import compose_in_order
    from hypic_rag.runtime.ops.conv_tail import stitch_conv_tails
    from hypic_rag.runtime.ops.rope import rotate_into

    device = model.device
    generator = torch.Generator(device=device).manual_seed(0)
    triton = backends.use_triton(torch.zeros(1, device=device))
    result: dict[str, Any] = {}

    def both(name: str, call: Callable[[str], Any]) -> None:
        result[f"{name}_torch_us"] = 1e6 * statistics.median(timed(lambda: call("torch"), device, repeats))
        if triton:
            result[f"{name}_triton_us"] = 1e6 * statistics.median(timed(lambda: call("triton"), device, repeats))
            torch_out, triton_out = call("torch"), call("triton")
            if isinstance(torch_out, torch.Tensor):
                result[f"{name}_max_error"] = float((torch_out.float() - triton_out.float()).abs().max())

    recurrent = next((block.recurrent for block in model.blocks if block.recurrent is not None), None)
    if recurrent is not None and recurrent.transition_kind is not None:
        kind, state_shape = recurrent.transition_kind, recurrent.state_shape
        transitions = torch.rand(maps, *recurrent.transition_shape, device=device, generator=generator)
        transitions = transitions * (0.5 / state_shape[-2] if kind == "matrix" else 0.95)
        states = torch.randn(maps, *state_shape, device=device, generator=generator)
        start = torch.randn(*state_shape, device=device, generator=generator)
        result["compose"] = {"kind": kind, "maps": maps, "state_shape": list(state_shape)}
        both("compose", lambda backend: compose_in_order(start, transitions, states, kind, backend=backend))
    if recurrent is not None and recurrent.conv_width > 0:
        sequences, spans = 8, 16
        tails = torch.randn(sequences * spans, recurrent.conv_channels, recurrent.conv_width, device=device,
                            generator=generator)
        lengths = torch.randint(1, 600, (sequences * spans,), device=device, generator=generator)
        result["conv_tail"] = {"sequences": sequences, "spans": spans, "channels": recurrent.conv_channels}
        both("conv_tail", lambda backend: stitch_conv_tails(None, tails, lengths, [spans] * sequences, backend=backend))
    attention = next((block.attention for block in model.blocks if block.attention is not None), None)
    if attention is not None and isinstance(attention.positions, RotaryPositions):
        hidden = torch.randn(chunk_tokens, model.config.hidden_size, device=device, dtype=model.dtype, generator=generator)
        keys = attention.project(hidden).key  # [Hkv, T, D]
        buffer = torch.empty(keys.shape[0], 16 * chunk_tokens, keys.shape[-1], device=device, dtype=model.dtype)
        cos, sin = attention.positions.tables(torch.arange(16 * chunk_tokens, device=device), keys)
        at = 7 * chunk_tokens
        result["rope"] = {"keys": list(keys.shape)}
        both("rope", lambda backend: rotate_into(buffer, at, keys, cos, sin, at, backend=backend))
    return result


def bench_family(kind: str, args: argparse.Namespace, budget: Budget,
                 save: Callable[[], None], family: dict[str, Any]) -> None:
    """Every measurement of one mixer kind into `family` (saved after each); errors are recorded, not raised."""
    from hypic_rag.bench import workloads as W
    from hypic_rag.bench.batching import ThroughputConfig, engine_throughput
    from hypic_rag.bench.measure import encoding_throughput
    from hypic_rag.runtime.model import resolve_dtype, wrap_model
    from hypic_rag.runtime.request import Request

    device = torch.device(args.device)
    began = time.perf_counter()
    spec = GPU_MODELS[kind]
    hf_model = build_gpu_model(kind, args.size, device, resolve_dtype(args.dtype), seed=args.seed)
    model = wrap_model(hf_model)
    family["model"] = {
        "model_type": spec["model_type"], "shape_of": spec["shape_of"] if args.size != "tiny" else "the tiny test config",
        "parameters": sum(p.numel() for p in hf_model.parameters()), "layers": len(model.layer_types),
        "layer_types": {kind_name: model.layer_types.count(kind_name) for kind_name in sorted(set(model.layer_types))},
        "build_seconds": time.perf_counter() - began,
    }
    save()
    tokens = W.TokenSource(hf_model.config.vocab_size, args.seed)
    family["ttft"] = []
    for k, chunk_tokens in args.prompts:
        if not budget.allows(f"{kind} k={k} x {chunk_tokens}"):
            break
        request = Request(tokens.ids(args.prefix_tokens), [tokens.ids(chunk_tokens) for _ in range(k)],
                          tokens.ids(args.question_tokens))
        row = {"k": k, "chunk_tokens": chunk_tokens}
        family["ttft"].append(row)
        measured = bench_ttft(model, request, seam_tokens=args.seam_tokens, repeats=args.repeats, budget=budget,
                              cap_seconds=args.measurement_seconds, on_measurement=lambda done: (row.update(done), save()))
        row.update(measured)
        save()

    def encoding() -> None:
        segments = [tokens.ids(args.encode_chunk_tokens) for _ in range(args.encode_chunks)]
        family["encoding"] = encoding_throughput(model, segments, args.seam_tokens)

    def throughput() -> None:
        workload = W.rag_qa(tokens, top_k=args.throughput_k, pool_size=2 * args.throughput_k,
                            chunk_tokens=args.throughput_chunk_tokens, requests=args.throughput_requests, warmup=0)
        config = ThroughputConfig(clients=(args.clients,), max_requests=args.throughput_requests,
                                  max_seconds=max(1.0, min(args.measurement_seconds, budget.left() / 2)),
                                  new_tokens=args.new_tokens, repeats=1)
        cells = engine_throughput(model, workload.requests, config, seam_tokens=args.seam_tokens)
        batched, one = cells["batched"][0], cells["one_at_a_time"][0]
        rates = {name: cell["requests_per_second"] * cell["mean_completion_tokens"] for name, cell in
                 (("batched", batched), ("one_at_a_time", one))}
        family["throughput"] = {
            "clients": args.clients, "new_tokens": args.new_tokens, "mode": config.mode,
            "batched": batched, "one_at_a_time": one,
            "batched_tokens_per_second": rates["batched"],
            "one_at_a_time_tokens_per_second": rates["one_at_a_time"],
            "batched_over_one": rates["batched"] / rates["one_at_a_time"] if rates["one_at_a_time"] else float("nan"),
        }

    def kernels() -> None:
        family["kernels"] = bench_kernels(model, maps=16, chunk_tokens=max(args.prompts)[1], repeats=10)

    for name, section in (("encoding", encoding), ("throughput", throughput), ("kernels", kernels)):
        if not budget.allows(f"{kind} {name}"):
            continue
        try:
            section()
        except Exception as error:  # the next section (and family) still run
            logger.exception("%s %s failed", kind, name)
            family.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
        save()
    del model, hf_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The targets per family at its largest prompt: value and whether it is met (None: not measured)."""
    out: dict[str, Any] = {}
    for kind, family in result["families"].items():
        rows = [row for row in family.get("ttft", []) if "hypic" in row.get("ttft_seconds", {})]
        largest = max(rows, key=lambda row: row["k"] * row["chunk_tokens"], default=None)
        wanted = TARGETS["hypic_vs_transformers"]["gated_deltanet" if kind == "gated_deltanet" else "other"]
        entry: dict[str, Any] = {"hypic_vs_transformers_wanted": wanted}
        if largest is not None:
            times = largest["ttft_seconds"]
            entry["prompt"] = f"{largest['k']} x {largest['chunk_tokens']}"
            if "transformers" in times:
                entry["hypic_vs_transformers"] = times["transformers"] / times["hypic"]
                entry["hypic_vs_transformers_met"] = entry["hypic_vs_transformers"] >= wanted
            if "transition_rope" in times:
                entry["hypic_over_transition_rope"] = times["hypic"] / times["transition_rope"]
                entry["hypic_over_transition_rope_met"] = entry["hypic_over_transition_rope"] <= TARGETS["hypic_over_transition_rope"]
        if "throughput" in family:
            ratio = family["throughput"]["batched_over_one"]
            entry["batched_over_one"] = ratio
            entry["batched_over_one_met"] = ratio >= TARGETS["batched_over_one"]
        out[kind] = entry
    return out


def machine() -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    versions = [f"torch {torch.__version__}"]
    for name in ("transformers", "triton", "fla"):
        try:
            module = __import__(name)
            versions.append(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            versions.append(f"{name} absent")
    return f"{device}; {platform.machine()}, {os.cpu_count()} CPU cores; python {platform.python_version()}; " + ", ".join(versions)


def run(args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole benchmark; `save` gets the result so far after every measurement."""
    from hypic_rag.runtime.ops import backends

    began = time.time()
    budget = Budget(args.budget_seconds)
    result: dict[str, Any] = {
        "benchmark": "hypic-rag gpu",
        "command": " ".join(["python3 -m hypic_rag.bench.gpu", *sys.argv[1:]]),
        "machine": machine(),
        "settings": {
            "kinds": args.kinds, "size": args.size, "device": args.device, "dtype": args.dtype,
            "prompts": [f"{k} x {tokens}" for k, tokens in args.prompts], "prefix_tokens": args.prefix_tokens,
            "question_tokens": args.question_tokens, "seam_tokens": args.seam_tokens, "repeats": args.repeats,
            "budget_seconds": args.budget_seconds, "clients": args.clients, "new_tokens": args.new_tokens,
            "HYPIC_RAG_KERNELS": os.environ.get("HYPIC_RAG_KERNELS", "auto"),
            "HYPIC_RAG_FLA_AUTOTUNE_CONFIGS": os.environ.get("HYPIC_RAG_FLA_AUTOTUNE_CONFIGS", "all (fla's own)"),
        },
        "cuda_kernels": backends.CUDA_KERNELS,
        "families": {},
    }

    def progress() -> None:
        result["targets"] = targets(result)
        result["seconds"] = time.time() - began
        if save is not None:
            save(result)

    for kind in args.kinds:
        family: dict[str, Any] = {}
        result["families"][kind] = family
        if not budget.allows(f"the {kind} model"):
            family["skipped"] = "time budget spent before it started"
            continue
        try:
            bench_family(kind, args, budget, progress, family)
        except Exception as error:  # one family's failure must not cost the others their numbers
            logger.exception("%s failed", kind)
            family["error"] = f"{type(error).__name__}: {error}"
            family["traceback"] = traceback.format_exc()[-4000:]
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        progress()
    result["complete"] = True
    progress()
    return result


def _cell(value: float | None, scale: float = 1e3, digits: int = 1) -> str:
    return "-" if value is None else f"{scale * value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        "# hypic-rag GPU benchmark", "",
        f"Machine: {result['machine']}", "",
        (
            f"Models: one random model per mixer kind, size '{settings['size']}', {settings['dtype']} on "
            f"{settings['device']}. Prompts: {settings['prefix_tokens']}-token prefix, k chunks x tokens "
            f"({', '.join(settings['prompts'])}), {settings['question_tokens']}-token question; seam "
            f"{settings['seam_tokens']}; TTFT medians of up to {settings['repeats']} runs after a warm-up; fla "
            f"autotuning: {settings['HYPIC_RAG_FLA_AUTOTUNE_CONFIGS']} configurations per kernel."
        ),
        "",
    ]
    for kind, family in result["families"].items():
        model = family.get("model", {})
        lines += [f"## {kind}", ""]
        if model:
            lines += [f"{model['model_type']} ({model['shape_of']}): {model['parameters'] / 1e6:,.0f}M parameters, "
                      f"{model['layers']} layers {model['layer_types']}.", ""]
        for note in ("skipped", "error"):
            if note in family:
                lines += [f"**{note}**: {family[note]}", ""]
        for name, error in family.get("errors", {}).items():
            lines += [f"**error** ({name}): {error}", ""]
        for row in family.get("ttft", []):
            for label, error in row.get("errors", {}).items():
                lines += [f"**error** ({label} at {row['k']} x {row['chunk_tokens']}): {error}", ""]
        rows = family.get("ttft", [])
        if rows:
            labels = ["transformers", *ENGINE_MODES]
            lines.append("| mode | " + " | ".join(f"{row['k']} x {row['chunk_tokens']} TTFT (ms) | x transformers"
                                                  for row in rows) + " |")
            lines.append("| --- |" + " --- | --- |" * len(rows))
            for label in labels:
                cells = []
                for row in rows:
                    seconds = row.get("ttft_seconds", {}).get(label)
                    speedup = row.get("speedup_vs_transformers", {}).get(label)
                    cells.append(f"{_cell(seconds)} | {_cell(speedup, 1.0)}")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
            lines.append("")
        if "encoding" in family:
            encoding = family["encoding"]
            lines += [f"Encoding: {encoding['encode_tokens_per_second']:.0f} tokens/s into entries "
                      f"({encoding['chunks']} chunks); transformers' forward over the same batch "
                      f"{encoding['transformers_forward_tokens_per_second']:.0f} tokens/s.", ""]
        if "throughput" in family:
            throughput = family["throughput"]
            lines += [f"Throughput at {throughput['clients']} clients ({throughput['mode']}, {throughput['new_tokens']}-token "
                      f"answers): batched {throughput['batched_tokens_per_second']:.1f} tokens/s, one at a time "
                      f"{throughput['one_at_a_time_tokens_per_second']:.1f} tokens/s: "
                      f"{throughput['batched_over_one']:.2f}x.", ""]
        if "kernels" in family:
            kernels = family["kernels"]
            parts = []
            for name in ("compose", "conv_tail", "rope"):
                if f"{name}_torch_us" in kernels:
                    triton_us = kernels.get(f"{name}_triton_us")
                    parts.append(f"{name}: torch {kernels[f'{name}_torch_us']:.1f} us, Triton "
                                 + ("not enabled here" if triton_us is None else f"{triton_us:.1f} us"))
            lines += ["Kernels (one call): " + "; ".join(parts) + ".", ""]
    if result.get("targets"):
        lines += ["## Targets (largest prompt)", "", "| kind | hypic x transformers (wanted) | hypic / transition_rope "
                  "(<= 1.3) | batched / one (>= 5) |", "| --- | --- | --- | --- |"]
        for kind, entry in result["targets"].items():
            def show(name: str, wanted: str = "") -> str:
                if name not in entry:
                    return "-"
                met = entry.get(f"{name}_met")
                return f"{entry[name]:.2f}{wanted} {'met' if met else 'NOT met'}"

            wanted = f" ({entry['hypic_vs_transformers_wanted']:.0f})"
            lines.append(f"| {kind} | {show('hypic_vs_transformers', wanted)} | "
                         f"{show('hypic_over_transition_rope')} | {show('batched_over_one')} |")
        lines.append("")
    if not result.get("complete"):
        lines += [f"Partial: the run stopped after {result.get('seconds', 0):.0f} s.", ""]
    else:
        lines += [f"Reproduce: `{result['command']}` ({result['seconds']:.0f} s).", ""]
    return "\n".join(lines)


def _prompt(text: str) -> tuple[int, int]:
    try:
        k, tokens = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a prompt is KxTOKENS (e.g. 16x512), got {text!r}") from None
    if k < 1 or tokens < 1:
        raise argparse.ArgumentTypeError(f"a prompt needs k >= 1 chunks of >= 1 tokens, got {text!r}")
    return k, tokens


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m hypic_rag.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--kinds", nargs="+", choices=MIXER_KINDS, default=list(MIXER_KINDS), help="mixer kinds, in order")
    parser.add_argument("--size", choices=("2b", "tiny"), default="2b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompts", type=_prompt, nargs="+", default=[(16, 512), (8, 256)],
                        help="KxTOKENS chunk layouts, in the order measured")
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--seam-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--measurement-seconds", type=float, default=15.0, help="no new run of one measurement after this")
    parser.add_argument("--encode-chunks", type=int, default=16)
    parser.add_argument("--encode-chunk-tokens", type=int, default=512)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--throughput-k", type=int, default=8)
    parser.add_argument("--throughput-chunk-tokens", type=int, default=256)
    parser.add_argument("--throughput-requests", type=int, default=16)
    parser.add_argument("--budget-seconds", type=float, default=330.0, help="the whole run's wall-clock budget")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("repeats", "encode_chunks", "encode_chunk_tokens", "clients", "new_tokens", "throughput_k",
                 "throughput_chunk_tokens", "throughput_requests", "prefix_tokens", "question_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.output.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        (args.output / "gpu_bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (args.output / "gpu_bench.md").write_text(markdown(result))

    result = run(args, save)
    print(markdown(result))
    return 1 if failures(result) else 0


def failures(result: dict[str, Any]) -> list[str]:
    """What failed: "kind" (the whole family), "kind: section" and "kind: mode at N tokens"."""
    found = []
    for kind, family in result["families"].items():
        if "error" in family:
            found.append(kind)
        found += [f"{kind}: {name}" for name in family.get("errors", {})]
        for row in family.get("ttft", []):
            found += [f"{kind}: {label} at {row['prompt_tokens']} tokens" for label in row.get("errors", {})]
    return found


if __name__ == "__main__":
    sys.exit(main())
