"""Render MODEL_CARD.md for an exported default model from its training settings and benchmark JSON files.

    python -m training.model_card --model hypic_rag/demo/assets/default_model \
        --run-dir runs/default/stage1 --run-dir runs/default/stage2 --run-dir runs/default/stage3 \
        --eval runs/eval_retriever.json --eval runs/eval_distractors.json --notes runs/card_notes.md

Give every training stage's run directory, in order (a single-stage run: one --run-dir).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODE_ORDER = ("hf", "full", "hypic", "transition_rope", "transition", "addition", "prefix")


def _percent(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{100 * value:.1f}%"


def _eval_table(report: dict) -> list[str]:
    lines = [
        f"Context: **{report['context']}**, k = {report['k']}, {report['questions']} questions (seed {report['seed']}), "
        f"two-hop share {report['two_hop_share']}, seam {report['seam_tokens']} tokens. Gold documents in the "
        f"context: {_percent(report['gold_recall'])} (single-hop {_percent(report['gold_recall_single_hop'])}, "
        f"two-hop {_percent(report['gold_recall_two_hop'])}).",
        "",
        "| mode | EM | single-hop EM | two-hop EM (bridge -> answer) | two-hop final-answer EM | EM when gold retrieved | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    modes = report["modes"]
    for mode in sorted(modes, key=lambda name: MODE_ORDER.index(name) if name in MODE_ORDER else 99):
        row = modes[mode]
        lines.append(
            f"| {mode} | {_percent(row['exact_match'])} | {_percent(row['single_hop_exact_match'])} | "
            f"{_percent(row['two_hop_exact_match'])} | {_percent(row['two_hop_final_answer_exact_match'])} | "
            f"{_percent(row.get('exact_match_when_gold_retrieved'))} | {row.get('seconds', 'n/a')} |"
        )
    return lines


def _stage_summary(run_dir: Path) -> tuple[int, float, dict, str]:
    """(last step, training minutes, settings, last validation exact match: `full`, and `/ hypic` when the stage
    measured it) of one stage's run directory."""
    settings = json.loads((run_dir / "settings.json").read_text())
    minutes, last_step, validation, validation_hypic = 0.0, 0, None, None
    metrics_path = run_dir / "metrics.jsonl"
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] > (settings.get("stop_at_step") or settings["total_steps"]):
                break  # steps past a stage's recorded stop were discarded (the next stage started earlier)
            minutes, last_step = record.get("minutes", minutes), record["step"]
            if "validation" in record:
                validation = record["validation"]["exact_match"]
                validation_hypic = record.get("validation_hypic", {}).get("exact_match")
    shown = _percent(validation) + (f" / {_percent(validation_hypic)}" if validation_hypic is not None else "")
    return last_step, minutes, settings, shown


def render_card(model_dir: Path, run_dirs: list[Path], eval_paths: list[Path], notes: str) -> str:
    """The model card text; run_dirs: the training stages' run directories, in order."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        parameters = sum(weights.get_slice(name).get_shape().numel() if hasattr(weights.get_slice(name).get_shape(), "numel")
                         else _product(weights.get_slice(name).get_shape()) for name in weights.keys())
    bundle_bytes = sum(path.stat().st_size for path in model_dir.rglob("*") if path.is_file() and path.name != "MODEL_CARD.md")
    stages = [(run_dir.name, *_stage_summary(run_dir)) for run_dir in run_dirs]
    total_steps = sum(stage[1] for stage in stages)
    total_minutes = sum(stage[2] for stage in stages)
    seed_limit = (max(stage[3]["seed"] for stage in stages) + 1) * 10_000_000
    layer_types = config["layer_types"]
    pattern = "".join("L" if kind == "linear_attention" else "A" for kind in layer_types)
    lines = [
        "# hypic-rag default model",
        "",
        "A small `qwen3_5` text model (gated-DeltaNet linear-attention layers and full-attention layers) trained from",
        "scratch on CPU on the synthetic multi-document QA corpus of `training/data/synthetic_qa.py`, in the",
        "query-time layout (prefix, k chunks, question, answer). It answers questions about the fictional entities of",
        "that corpus (see `hypic_rag/demo/assets/example_corpus/`); it knows nothing else and is not a general language model.",
        "",
        "## Size and architecture",
        f"- {parameters:,} parameters (tied embeddings), stored as float32 safetensors; bundle {bundle_bytes / 2**20:.1f} MiB.",
        f"- {config['num_hidden_layers']} layers, pattern `{pattern}` (L = gated DeltaNet, A = full attention), hidden "
        f"{config['hidden_size']}, attention {config['num_attention_heads']} heads x {config['head_dim']} "
        f"({config['num_key_value_heads']} KV heads), linear {config['linear_num_value_heads']} value heads x "
        f"{config['linear_value_head_dim']}, conv kernel {config['linear_conv_kernel_dim']}, MLP {config['intermediate_size']}.",
        f"- Byte-level BPE tokenizer of {config['vocab_size']} tokens trained on the corpus; every invented name is one token.",
        "",
        "## Training",
        f"- {total_steps} steps in {len(stages)} stage(s), {total_minutes:.0f} minutes of training (steps only, evaluation "
        "excluded) on a 2-core CPU (shared at times with evaluation jobs, which slowed some steps).",
        "",
        "| stage | steps | minutes | seed | last validation EM, gold + random distractors (`full` / `hypic`) | settings |",
        "| --- | --- | --- | --- | --- | --- |",
        *[
            f"| {name} | {steps} | {minutes:.0f} | {settings['seed']} | {validation} | "
            f"`{json.dumps({k: v for k, v in settings.items() if k != 'shape'})}` |"
            for name, steps, minutes, settings, validation in stages
        ],
        "",
        f"- Data: worlds of seeds below {seed_limit:,} (a stage of seed s uses [s x 10,000,000 + 1, (s + 1) x 10,000,000); "
        "24 people, 10 organisations, 10 places, 10 products each);",
        "  validation worlds 500,000,000+; held-out benchmark worlds 900,000,000+; example corpus world 777,000,000.",
        "- Reproduce: `training/train_default_model.py` (see `docs/default_model.md`).",
        "",
        "## Measured accuracy (held-out, exact match, greedy)",
        "`hf` is transformers' own forward; the other rows are the runtime's modes (`Engine.generate`).",
        "",
    ]
    for path in eval_paths:
        lines += _eval_table(json.loads(path.read_text())) + [""]
    lines += ["## Notes", "", notes.strip(), ""]
    return "\n".join(lines)


def _product(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, action="append", required=True, help="a stage's run directory (repeat, in order)")
    parser.add_argument("--eval", type=Path, action="append", default=[])
    parser.add_argument("--notes", type=Path, default=None)
    args = parser.parse_args(argv)
    notes = args.notes.read_text() if args.notes else ""
    (args.model / "MODEL_CARD.md").write_text(render_card(args.model, args.run_dir, args.eval, notes))
    print(args.model / "MODEL_CARD.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
