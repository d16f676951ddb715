"""`hypic-rag bench --families`: per model family, cache bytes per chunk at a published checkpoint's shapes and
hypic's time to first token against transformers' own forward on a ~100-200M random model of the family.

Two parts (JSON `families.json`, markdown `families.md`; `--profile test`: `families_test.*`, tiny models):
1. bytes (`family_bytes`): every published layout of `published_layouts`, computed on the meta device from the
   runtime's own entry (seconds, no weights);
2. time to first token (`family_timing`): each family's timing model (`family_models`), k = 8 chunks x 256 tokens,
   warm cache, 2 threads, medians of 3 requests per path. Sized to finish in about 10-15 minutes on 2 shared CPU
   cores (3 runs, not more: each transformers forward of a 2100-token prompt costs seconds).

The machine's load average is recorded before and after: on a shared machine timings are noisy.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hypic_rag.bench.family_bytes import published_rows
from hypic_rag.bench.family_models import TIMING_FAMILIES
from hypic_rag.bench.family_timing import FamilyTimingConfig, time_family
from hypic_rag.bench.published_layouts import PUBLISHED_LAYOUTS

logger = logging.getLogger(__name__)

MIB = 2**20


@dataclass(frozen=True, slots=True)
class FamiliesBenchConfig:
    """profile: "standard" or "test"; timing: the TTFT part's sizes; byte_families / timing_families: which
    families each part covers (keys of `PUBLISHED_LAYOUTS` / `TIMING_FAMILIES`)."""

    profile: str
    timing: FamilyTimingConfig
    byte_families: tuple[str, ...] = tuple(PUBLISHED_LAYOUTS)
    timing_families: tuple[str, ...] = TIMING_FAMILIES

    def __post_init__(self) -> None:
        unknown = sorted(set(self.byte_families) - set(PUBLISHED_LAYOUTS))
        unknown += sorted(set(self.timing_families) - set(TIMING_FAMILIES))
        if unknown:
            raise ValueError(f"unknown families {unknown}")
        if not self.byte_families and not self.timing_families:
            raise ValueError("no family to benchmark")

    def only(self, families: list[str]) -> FamiliesBenchConfig:
        """This config restricted to `families` (model types of either part; ValueError naming an unknown one)."""
        known = set(PUBLISHED_LAYOUTS) | set(TIMING_FAMILIES)
        unknown = [name for name in families if name not in known]
        if unknown:
            raise ValueError(f"unknown family {unknown[0]!r}; choose from {', '.join(sorted(known))}")
        return replace(self, byte_families=tuple(f for f in self.byte_families if f in families),
                       timing_families=tuple(f for f in self.timing_families if f in families))


FAMILIES_PROFILES: dict[str, FamiliesBenchConfig] = {
    "standard": FamiliesBenchConfig("standard", FamilyTimingConfig()),
    "test": FamiliesBenchConfig("test", FamilyTimingConfig(chunk_tokens=24, top_k=4, runs=1, seam_tokens=4,
                                                           tiny=True)),
}


def run_families(config: FamiliesBenchConfig, *, command: str, seed: int = 0) -> dict[str, Any]:
    """Both parts for the families of `config`; the result dict `families_markdown` renders."""
    from hypic_rag.bench.run import machine_description

    began, load_before = time.time(), os.getloadavg()
    byte_rows = published_rows(list(config.byte_families))
    timing_rows = [time_family(name, config.timing, seed=seed) for name in config.timing_families]
    return {
        "benchmark": "hypic-rag families",
        "command": command,
        "machine": machine_description(),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "config": {"profile": config.profile, "timing": {name: getattr(config.timing, name)
                                                         for name in config.timing.__slots__}},
        "cache_bytes_per_chunk": byte_rows,
        "time_to_first_token": timing_rows,
        "seconds": time.time() - began,
    }


def _mib(value: int) -> str:
    return f"{value / MIB:.2f}"


def _kinds(row: dict[str, Any]) -> str:
    short = {"linear_attention": "rec", "full_attention": "attn", "linear_attention+full_attention": "rec+attn",
             "mlp": "mlp"}
    return ", ".join(f"{count} {short.get(kind, kind)}" for kind, count in row["layer_kinds"].items())


BYTES_NOTE = (
    "From the entry the runtime encodes, built on the meta device from the checkpoint's transformers config (no "
    "weights): P, Z and conv tails float32, K/V in the model's dtype (bfloat16); MiB = 2^20. `P/Z bf16`: the entry "
    "with P and Z stored in bfloat16 (a cache namespace's state dtype). Layers: rec = recurrent mixer (linear "
    "attention, SSM, short conv), attn = attention, mlp = feed-forward only."
)
BYTES_HEADER = (
    "| family | checkpoint | layers | recurrent mixer (transition) | attention positions | P | Z | conv tails "
    "| linear state | K/V | total | P/Z bf16 |"
)
TIMING_NOTE = (
    "Random float32 models of each family (`hypic_rag.bench.family_models`), one prompt shape for all three paths: "
    "a 32-token prefix, k = {top_k} chunks x {chunk_tokens} tokens, a 24-token question; warm cache (entries encoded "
    "before timing; no timed request encodes), seam {seam_tokens}, {threads} threads; medians of {runs} request(s) "
    "per path, run interleaved. `full / tf`: our full recompute's time over transformers' forward of the same "
    "prompt; `max |dlogit|`: between those two logits (the same computation); KL: `hypic` against `full` on random "
    "weights (their greedy agreement is in the JSON: on near-uniform random logits the argmax is noise)."
)
TIMING_HEADER = (
    "| family | parameters | layers | prompt tokens | transformers (s) | full (s) | hypic (s) | full / tf "
    "| hypic speed-up vs tf | vs full | max \\|dlogit\\| full vs tf | KL(full ‖ hypic) |"
)


def _separator(header: str) -> str:
    """The markdown separator row of a table with `header` (escaped pipes inside a cell do not count)."""
    return "|" + " --- |" * (len(re.findall(r"(?<!\\)\|", header)) - 1)


def families_markdown(result: dict[str, Any]) -> str:
    """The two tables, with where each checkpoint's shapes come from and how the timings were taken."""
    before, after = result["load_average_before"][0], result["load_average_after"][0]
    lines = [f"# hypic-rag benchmark: model families ({result['config']['profile']})", "",
             (f"Machine: {result['machine']}; load average {before:.1f} before, {after:.1f} after (a shared "
              "machine: timings are noisy)."), ""]
    byte_rows = result["cache_bytes_per_chunk"]
    if byte_rows:
        chunk = byte_rows[0]["chunk_tokens"]
        lines += [f"## Cache bytes per {chunk}-token chunk at published checkpoints' shapes", "", BYTES_NOTE, "",
                  BYTES_HEADER, _separator(BYTES_HEADER)]
        for row in byte_rows:
            sizes = {name: _mib(value) for name, value in row["bytes"].items()}
            mixers = ", ".join(row["recurrent_mixers"]) or "-"
            positions = ", ".join(row["attention_positions"]) or "-"
            lines.append(
                f"| `{row['model_type']}` | {row['checkpoint']} | {_kinds(row)} | {mixers} | {positions} "
                f"| {sizes['transition']} | {sizes['suffix_state']} | {sizes['conv_tail']} | {sizes['linear_state']} "
                f"| {sizes['key_value']} | **{sizes['total']}** | {sizes['pz_bfloat16_total']} |")
        lines += ["", "Where the shapes come from:", ""]
        lines += [f"- {row['checkpoint']}: {row['source']}." for row in byte_rows]
    timing_rows = result["time_to_first_token"]
    if timing_rows:
        lines += ["", "## Time to first token: transformers' forward, `full` and `hypic`", "",
                  TIMING_NOTE.format(**result["config"]["timing"]), "", TIMING_HEADER, _separator(TIMING_HEADER)]
        for row in timing_rows:
            medians = row["ttft_median"]
            lines.append(
                f"| `{row['model_type']}` | {row['parameters'] / 1e6:.3g}M | {_kinds(row)} | {row['prompt_tokens']} "
                f"| {medians['transformers']:.2f} | {medians['full']:.2f} | {medians['hypic']:.3f} "
                f"| {row['full_over_transformers']:.2f} | **{row['hypic_speedup_vs_transformers']:.1f}x** "
                f"| {row['hypic_speedup_vs_full']:.1f}x | {row['max_abs_logit_diff_full_vs_transformers']:.1e} "
                f"| {row['kl_full_hypic']:.3g} |")
    lines += ["", f"Reproduce: `{result['command']}` ({result['seconds']:.0f} s)."]
    return "\n".join(lines) + "\n"


def write_families(result: dict[str, Any], directory: Path) -> list[Path]:
    """`families.json` and `families.md` (`families_<profile>.*` for a profile other than standard)."""
    from hypic_rag.bench.report import write_json_and_markdown

    profile = result["config"]["profile"]
    stem = "families" if profile == "standard" else f"families_{profile}"
    return write_json_and_markdown(result, directory, stem, families_markdown(result))
