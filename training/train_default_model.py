#!/usr/bin/env python
"""Train the bundled default model: the three stages of its recipe, in order, each resumable; see docs/default_model.md.

    OMP_WAIT_POLICY=PASSIVE python -m training.train_default_model --run-root runs/default [--max-minutes 60]
    OMP_WAIT_POLICY=PASSIVE python -m training.train_default_model --run-root runs/default --export hypic_rag/demo/assets/default_model

Each stage is a run directory under --run-root (`python -m training` trains one run); a later stage
starts from the previous stage's checkpoint (weights and optimizer moments) with its own seed (fresh worlds) and
learning-rate schedule. Re-running continues where it stopped; --max-minutes bounds one invocation.

1. `stage1`: copy-task warm-up (180 steps) that builds the induction circuit, then QA contexts with a document
   curriculum (1 -> 8 documents), q/k norm gain 2, lr 3e-3, 1,100 steps.
2. `stage2`: QA contexts of 6-9 random documents, lr 1e-3 (schedule of 2,300 steps, stopped at step 500).
3. `stage3`: as stage 2 with 60% of contexts built from confusable documents (same kind, shared values: what a
   retriever returns around a gold document), 2,000 steps.
4. `stage4`: the cached layout (`training/block_layout.py`): 70% of contexts see their chunks as the
   segment cache serves them under `hypic` (encoded standalone, composed, seam window of 4-16 tokens recomputed),
   80% confusable contexts, lr 5e-4, 850 steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

STAGES: list[tuple[str, dict]] = [
    ("stage1", {"seed": 0, "total_steps": 1100, "eval_questions": 30}),
    ("stage2", {"init_from": "stage1", "seed": 1, "copy_warmup_steps": 0, "curriculum_steps": 0, "total_steps": 2300,
                "stop_at_step": 500, "learning_rate": 1e-3, "warmup_steps": 20, "eval_every": 200}),
    ("stage3", {"init_from": "stage2", "seed": 2, "copy_warmup_steps": 0, "curriculum_steps": 0, "total_steps": 2000,
                "learning_rate": 1e-3, "warmup_steps": 20, "eval_every": 250, "hard_negative_share": 0.6}),
    ("stage4", {"init_from": "stage3", "seed": 3, "copy_warmup_steps": 0, "curriculum_steps": 0, "total_steps": 850,
                "learning_rate": 5e-4, "warmup_steps": 20, "eval_every": 100, "hard_negative_share": 0.8,
                "block_layout_share": 0.7, "block_seams": (4, 8, 8, 16)}),
]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-root", type=Path, required=True, help="directory holding one run directory per stage")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop this invocation after about this long")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--export", type=Path, default=None, help="write the last stage's model here when it is done")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    from training.trainer import Trainer, TrainSettings

    began = time.monotonic()
    trainer = None
    for name, values in STAGES:
        values = dict(values)
        if "init_from" in values:
            values["init_from"] = str(args.run_root / values["init_from"])
        settings = replace(TrainSettings(**values), threads=args.threads)
        if args.max_minutes is not None:
            left = args.max_minutes - (time.monotonic() - began) / 60
            if left <= 0:
                logging.info("time budget spent before %s; run again to continue", name)
                return 0
            settings = replace(settings, max_minutes=left)
        trainer = Trainer(args.run_root / name, settings)
        last = settings.stop_at_step or settings.total_steps
        if trainer.step < last:
            trainer.train()
        if trainer.step < last:
            logging.info("%s stopped at step %d of %d; run again to continue", name, trainer.step, last)
            return 0
    if args.export is not None and trainer is not None:
        print(trainer.export(args.export))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
