"""`python -m training`: train the default model (resumable) and export it.

    python -m training train --run-dir runs/default --total-steps 1200
    python -m training export --run-dir runs/default --out hypic_rag/demo/assets/default_model
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

from training.model_config import ModelShape
from training.trainer import Trainer, TrainSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train (or resume) a run")
    train.add_argument("--run-dir", type=Path, required=True)
    for settings_field in dataclasses.fields(TrainSettings):
        if settings_field.name == "shape":
            continue
        kind = float if settings_field.name == "max_minutes" else type(settings_field.default)
        train.add_argument(f"--{settings_field.name.replace('_', '-')}", type=kind, default=None)
    for shape_field in dataclasses.fields(ModelShape):
        train.add_argument(f"--{shape_field.name.replace('_', '-')}", type=int, default=None)
    export = commands.add_parser("export", help="write the run's model as a transformers checkpoint directory")
    export.add_argument("--run-dir", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True)
    return parser


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    shape_values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ModelShape) if getattr(args, f.name) is not None}
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)
              if f.name != "shape" and getattr(args, f.name) is not None}
    return TrainSettings(shape=ModelShape(**shape_values), **values)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    handlers = [logging.StreamHandler(sys.stderr), logging.FileHandler(args.run_dir / "train.log")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers)
    if args.command == "train":
        Trainer(args.run_dir, settings_from_args(args)).train()
    else:
        print(Trainer(args.run_dir).export(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
