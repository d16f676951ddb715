"""Deviation of every mode from `full` on tiny random qwen3_5 models (the quality ladder of docs/runtime.md).

Mean KL(full || mode) of next-token distributions and greedy next-token agreement over N random requests,
for seam windows 2 and 8, on models with slow and with default decays. JSON to stdout (or --output).

    OMP_WAIT_POLICY=PASSIVE python -m hypic_rag.bench.mode_deviation --requests 20
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import wrap_model
from hypic_rag.runtime.quality import kl_divergence
from hypic_rag.runtime.request import Request
from hypic_rag.testing import build_tiny_model

LADDER = ("hypic@8", "hypic@2", "transition_rope", "transition", "addition", "prefix")


def measure(seed: int, slow_decay: bool, requests: int, layers: int, initializer_range: float) -> dict:
    hf_model = build_tiny_model("qwen3_5", seed=seed, slow_decay=slow_decay, num_hidden_layers=layers, initializer_range=initializer_range)
    engine = Engine(wrap_model(hf_model))
    generator = torch.Generator().manual_seed(seed)
    kl = {mode: 0.0 for mode in LADDER}
    agree = {mode: 0 for mode in LADDER}
    for _ in range(requests):
        count = int(torch.randint(2, 6, (1,), generator=generator))
        ids = lambda n: torch.randint(0, hf_model.config.vocab_size, (n,), generator=generator).tolist()  # noqa: E731
        request = Request(ids(6), [ids(int(torch.randint(16, 48, (1,), generator=generator))) for _ in range(count)], ids(8))
        reference = engine.prefill(request, "full").logits
        for label in LADDER:
            mode, _, seam = label.partition("@")
            logits = engine.prefill(request, mode, seam_tokens=int(seam) if seam else None).logits
            kl[label] += kl_divergence(reference, logits) / requests
            agree[label] += int(logits.argmax() == reference.argmax())
    return {
        "seed": seed,
        "slow_decay": slow_decay,
        "mean_kl": kl,
        "greedy_agreement": {label: agree[label] / requests for label in LADDER},
        "ordered_hypic_lt_transition_rope_lt_addition": kl["hypic@8"] < kl["transition_rope"] < kl["addition"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--initializer-range", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    began = time.time()
    runs = [measure(seed, slow, args.requests, args.layers, args.initializer_range) for seed in args.seeds for slow in (True, False)]
    report = {
        "benchmark": "mode_deviation",
        "machine": f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}, {torch.get_num_threads()} threads",
        "model": f"tiny random qwen3_5, {args.layers} layers (3:1), hidden 64, initializer_range {args.initializer_range}, q/k norm gain ~2.5",
        "requests_per_run": args.requests,
        "runs": runs,
        "seconds": round(time.time() - began, 1),
    }
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
