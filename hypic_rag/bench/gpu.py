"""The GPU benchmark: time to first token on a random model with Qwen3.5-2B-like shapes in bf16.

For k = 8 and 16 chunks of 512 tokens (plus a 64-token prefix and a 32-token question), on one request:
- `transformers`: the model's own forward over the whole prompt (`use_cache=True`, logits of the last token only);
- `full`, `prefix`, `transition_rope`, `hypic`: the runtime's modes through `Engine.prefill`, the segment entries
  already encoded (a warm cache) and held in host memory as the engine keeps them today (copied to the GPU per
  request), and again with the entries resident on the GPU (`... (resident)`: the HYPIC paper keeps its cache in
  GPU memory);
- `prefix` reuses what an earlier request with the same prefix and first chunk (then another chunk, then these in
  another order) left behind: the usual RAG case, where the same chunks come back in a different order.
Each row is the median of `repeats` timed runs after one untimed warm-up (compiles Triton / fla kernels). Two kernel
micro-benchmarks follow: composing 16 cached (P, Z) of one layer (Triton vs the torch loop) and re-positioning a
chunk's keys (Triton into the buffer vs apply_rotary + copy).

    PYTHONPATH=. python3 -m hypic_rag.bench.gpu --output DIR     # writes DIR/gpu_bench.json and DIR/gpu_bench.md

`--shape tiny --device cpu` runs the same code in seconds on CPU (what the test suite does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen3.5-2B-like (our reading of the family's small dense layout; random weights): 24 layers, 18 Gated DeltaNet
    # (16 key / 16 value heads x 128) + 6 gated attention (8 query / 2 KV heads x 256, partial rotary 1/4 with
    # interleaved M-RoPE sections), hidden 2048, MLP 6144, vocab 248320 with tied embeddings: 1.88B parameters.
    "2b": {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "intermediate_size": 6144, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
            "mrope_interleaved": True, "mrope_section": [11, 11, 10],
        },
    },
    # the test suite's tiny shape (CPU smoke runs)
    "tiny": {"vocab_size": 256},
}

def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random qwen3_5 causal LM of `shape`, built directly on `device` in `dtype` (no float32 copy on the host)."""
    from transformers import AutoModelForCausalLM

    from hypic_rag.testing import tiny_config

    config = tiny_config("qwen3_5", initializer_range=0.02, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


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


def _engine_class():
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.get_or_encode import SegmentEntries, on_device

    class ResidentEntries(SegmentEntries):
        """Entries encoded on the model's device stay there (a cache in GPU memory)."""

        def encode(self, segments, seam_tokens, *, check=None):
            device = self.model.device
            return [on_device(entry, device) for entry in super().encode(segments, seam_tokens, check=check)]

    class ResidentEngine(Engine):
        """Keeps its in-memory segment entries on the model's device (`ResidentEntries`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            entries = self.entries
            self.entries = ResidentEntries(self.model, entries.source, batch_tokens=entries.batch_tokens,
                                           miss_encoder=entries.miss_encoder)

    return Engine, ResidentEngine


STAT_NAMES = ("recomputed_tokens", "cached_tokens", "prefix_reused_tokens", "cache_bytes_loaded")


def bench_ttft(hf_model, model, *, ks: list[int], chunk_tokens: int, prefix_tokens: int, question_tokens: int,
               seam_tokens: int, repeats: int, seed: int = 0,
               on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """TTFT rows (seconds, medians) per k: transformers' forward and each mode, host-held and resident entries;
    `on_row` gets the rows so far after each k (partial results survive a time limit)."""
    from hypic_rag.runtime.request import Request

    vocab = hf_model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    rows = []
    for k in ks:
        chunks = [ids(chunk_tokens) for _ in range(k)]
        prefix, question = ids(prefix_tokens), ids(question_tokens)
        request = Request(prefix, chunks, question)
        # an earlier request that retrieved the same first chunk, then another one and the rest in another order
        earlier = Request(prefix, [chunks[0], ids(chunk_tokens), *reversed(chunks[1:])], ids(question_tokens))
        row = _bench_request(hf_model, model, request, earlier, seam_tokens=seam_tokens, repeats=repeats)
        rows.append({"k": k, **row})
        logger.info("k=%d: %s", k, {mode: round(value, 4) for mode, value in row["ttft_seconds"].items()})
        if on_row is not None:
            on_row(rows)
    return rows


def _bench_request(hf_model, model, request, earlier, *, seam_tokens: int, repeats: int) -> dict[str, Any]:
    """One request's TTFT under transformers' forward and each mode (see the module docstring)."""
    Engine, ResidentEngine = _engine_class()
    device = model.device
    prompt = torch.tensor([request.all_ids()], device=device)
    row: dict[str, Any] = {"prompt_tokens": request.prompt_tokens, "ttft_seconds": {}, "stats": {}}

    @torch.no_grad()
    def transformers_forward() -> None:
        int(hf_model(prompt, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())

    row["ttft_seconds"]["transformers"] = statistics.median(timed(transformers_forward, device, repeats))

    def record(label: str, engine: Callable[[], Any], setup: Callable[[], Any] | None = None) -> None:
        mode, stats = label.split(" ")[0], {}

        def prefill() -> None:
            result = engine().prefill(request, mode)
            int(result.logits.argmax())
            stats.update(result.stats.as_dict())

        row["ttft_seconds"][label] = statistics.median(timed(prefill, device, repeats, setup))
        row["stats"][label] = {name: stats[name] for name in STAT_NAMES}

    plain = Engine(model, seam_tokens=seam_tokens)
    record("full", lambda: plain)
    # prefix: a fresh engine per run that has seen only the earlier request (a timed run must not find the
    # checkpoints its previous run left)
    prefix_engine: list[Any] = []

    def fresh_prefix_engine() -> None:
        prefix_engine[:] = [Engine(model, seam_tokens=seam_tokens, prefix_cache_bytes=64 << 30)]
        prefix_engine[0].prefill(earlier, "prefix")

    record("prefix", lambda: prefix_engine[0], fresh_prefix_engine)
    prefix_engine.clear()
    for suffix, engine_class in (("", Engine), (" (resident)", ResidentEngine)):
        warm = engine_class(model, seam_tokens=seam_tokens, memory_cache_bytes=64 << 30)
        for mode in ("transition_rope", "hypic"):
            record(mode + suffix, lambda warm=warm: warm)  # the untimed warm-up run encodes the entries
        del warm
    baseline = row["ttft_seconds"]["transformers"]
    row["speedup_vs_transformers"] = {label: baseline / value for label, value in row["ttft_seconds"].items()}
    return row


def bench_kernels(model, *, maps: int, chunk_tokens: int, repeats: int) -> dict[str, Any]:
    """Microseconds per call: composing `maps` cached (P, Z) of one linear layer, and re-positioning one chunk's
    keys into a K buffer, Triton against torch (only where the Triton path is enabled)."""
    from hypic_rag.kernels import triton_enabled
    from hypic_rag.runtime import layers as L
    from hypic_rag.runtime.segment_state import SegmentState

    device = model.device
    config = model.config
    heads, key_dim, value_dim = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    generator = torch.Generator(device=device).manual_seed(0)
    transitions = torch.randn(maps, heads, key_dim, key_dim, device=device, generator=generator) * 0.5 * key_dim**-0.5
    states = torch.randn(maps, heads, key_dim, value_dim, device=device, generator=generator)
    start = torch.randn(heads, key_dim, value_dim, device=device, generator=generator)

    def torch_compose() -> torch.Tensor:
        state = start
        for index in range(maps):
            state = SegmentState(transitions[index], states[index]).apply(state)
        return state

    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    keys = torch.randn(kv_heads, chunk_tokens, head_dim, device=device, dtype=model.dtype, generator=generator)
    buffer = torch.empty(kv_heads, 16 * chunk_tokens, head_dim, device=device, dtype=model.dtype)
    positions = torch.arange(16 * chunk_tokens, device=device)
    cos, sin = L.rotary_tables(model.backbone.rotary_emb, positions, keys)
    at = 7 * chunk_tokens

    def torch_rope() -> None:
        buffer[:, at : at + chunk_tokens] = L.apply_rotary(keys, cos[at : at + chunk_tokens], sin[at : at + chunk_tokens])

    result: dict[str, Any] = {
        "maps": maps, "heads": heads, "key_dim": key_dim, "value_dim": value_dim, "chunk_tokens": chunk_tokens,
        "compose_torch_us": 1e6 * statistics.median(timed(torch_compose, device, repeats)),
        "rope_torch_us": 1e6 * statistics.median(timed(torch_rope, device, repeats)),
    }
    if triton_enabled(start):
        from hypic_rag.kernels.compose import compose_affine
        from hypic_rag.kernels.rope import rope_into

        result["compose_triton_us"] = 1e6 * statistics.median(
            timed(lambda: compose_affine(start, transitions, states), device, repeats)
        )
        result["compose_max_error"] = float((compose_affine(start, transitions, states) - torch_compose()).abs().max())
        result["rope_triton_us"] = 1e6 * statistics.median(
            timed(lambda: rope_into(buffer, at, keys, cos, sin, at), device, repeats)
        )
    return result


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
    """The whole benchmark; `save` gets the result so far after each k and at the end."""
    from hypic_rag.runtime.model import resolve_dtype, wrap_model

    began = time.time()
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype)
    hf_model = build_model(args.shape, device, dtype, seed=args.seed)
    model = wrap_model(hf_model)
    parameters = sum(p.numel() for p in hf_model.parameters())
    result: dict[str, Any] = {
        "benchmark": "hypic-rag gpu",
        "command": " ".join(["python3 -m hypic_rag.bench.gpu", *sys.argv[1:]]),
        "machine": machine(),
        "model": {
            "shape": args.shape, "parameters": parameters, "dtype": args.dtype, "device": str(device),
            "layers": hf_model.config.num_hidden_layers,
            "linear_layers": model.layer_types.count("linear_attention"),
            "attention_layers": model.layer_types.count("full_attention"),
        },
        "settings": {
            "ks": args.ks, "chunk_tokens": args.chunk_tokens, "prefix_tokens": args.prefix_tokens,
            "question_tokens": args.question_tokens, "seam_tokens": args.seam_tokens, "repeats": args.repeats,
            "HYPIC_RAG_KERNELS": os.environ.get("HYPIC_RAG_KERNELS", "auto"),
        },
        "ttft": [],
    }

    def progress(rows: list[dict[str, Any]]) -> None:
        result["ttft"] = rows
        result["seconds"] = time.time() - began
        if save is not None:
            save(result)

    bench_ttft(
        hf_model, model, ks=args.ks, chunk_tokens=args.chunk_tokens, prefix_tokens=args.prefix_tokens,
        question_tokens=args.question_tokens, seam_tokens=args.seam_tokens, repeats=args.repeats, seed=args.seed,
        on_row=progress,
    )
    result["kernels"] = bench_kernels(model, maps=max(args.ks), chunk_tokens=args.chunk_tokens, repeats=max(args.repeats, 10))
    largest = max(result["ttft"], key=lambda row: row["k"])
    result["target"] = {
        "k": largest["k"],
        "hypic_speedup_vs_transformers": largest["speedup_vs_transformers"]["hypic"],
        "hypic_resident_speedup_vs_transformers": largest["speedup_vs_transformers"]["hypic (resident)"],
        "wanted": 20.0,
    }
    result["seconds"] = time.time() - began
    if save is not None:
        save(result)
    return result


def markdown(result: dict[str, Any]) -> str:
    model, settings = result["model"], result["settings"]
    lines = [
        "# hypic-rag GPU benchmark", "",
        f"Machine: {result['machine']}", "",
        (
            f"Model: random qwen3_5 '{model['shape']}', {model['parameters'] / 1e9:.2f}B parameters, {model['layers']} "
            f"layers ({model['linear_layers']} Gated DeltaNet, {model['attention_layers']} attention), {model['dtype']} "
            f"on {model['device']}. Prompt: {settings['prefix_tokens']}-token prefix, k chunks of "
            f"{settings['chunk_tokens']} tokens, {settings['question_tokens']}-token question; seam "
            f"{settings['seam_tokens']}; median of {settings['repeats']} runs."
        ),
        "",
    ]
    rows = sorted(result["ttft"], key=lambda row: row["k"])
    modes = list(rows[0]["ttft_seconds"]) if rows else []
    lines.append("| mode | " + " | ".join(f"k={row['k']} TTFT (ms) | x vs transformers" for row in rows) + " |")
    lines.append("| --- |" + " --- | --- |" * len(rows))
    for mode in modes:
        cells = []
        for row in rows:
            cells.append(f"{1e3 * row['ttft_seconds'][mode]:.1f} | {row['speedup_vs_transformers'][mode]:.1f}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    if "target" not in result:  # a partial result (the run stopped before the end)
        lines += ["", f"Partial: {len(rows)} of {len(result['settings']['ks'])} prompt sizes done after {result.get('seconds', 0):.0f} s."]
        return "\n".join(lines) + "\n"
    target = result["target"]
    lines += [
        "",
        (
            f"Target: hypic at least {target['wanted']:.0f}x faster than transformers' forward at "
            f"k={target['k']}: {target['hypic_speedup_vs_transformers']:.1f}x with host-held entries, "
            f"{target['hypic_resident_speedup_vs_transformers']:.1f}x with entries resident on the GPU."
        ),
        "", "Kernels (one call, microseconds):", "",
    ]
    kernels = result["kernels"]
    lines.append(f"- compose {kernels['maps']} maps of [{kernels['heads']}, {kernels['key_dim']}, {kernels['value_dim']}]: "
                 f"Triton {kernels.get('compose_triton_us', float('nan')):.1f}, torch loop {kernels['compose_torch_us']:.1f}"
                 + (f" (max difference {kernels['compose_max_error']:.1e})" if "compose_max_error" in kernels else ""))
    lines.append(f"- RoPE of {kernels['chunk_tokens']} cached keys into the K buffer: Triton "
                 f"{kernels.get('rope_triton_us', float('nan')):.1f}, apply_rotary + copy {kernels['rope_torch_us']:.1f}")
    lines += ["", f"Reproduce: `{result['command']}` ({result['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m hypic_rag.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="directory for gpu_bench.json and gpu_bench.md")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 8], help="chunks per prompt, in the order measured")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--seam-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.output.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        (args.output / "gpu_bench.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.output / "gpu_bench.md").write_text(markdown(result))

    print(markdown(run(args, save)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
