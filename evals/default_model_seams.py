"""Why a mode's accuracy differs from `full` on the bundled default model: seam size and per-mode deviation.

Over N held-out questions with the real retriever's top-k chunks (as `evals/eval_default_model.py`), for each
mode and seam window: exact match, agreement of the greedy answer with `full`'s, and mean KL(full || mode) of
the first answer token's distribution. JSON to stdout (or --out).

    OMP_WAIT_POLICY=PASSIVE python -m evals.default_model_seams --questions 200 --seams 0,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hypic_rag.demo.default_model import default_model_path
from training.evaluate import EvalItem, summarize
from training.data.synthetic_qa import HELDOUT_SEED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seams", default="0,2,4,8,16,32", help="hypic seam windows (tokens)")
    parser.add_argument("--modes", default="transition_rope,transition,addition", help="other modes, compared once")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model
    from hypic_rag.runtime.quality import kl_divergence
    from hypic_rag.runtime.request import Request
    from hypic_rag.runtime.sampling import SamplingParams
    from training.heldout_retrieval import retrieved_cases
    from training.packing import SegmentEncoder

    model = load_model(args.model, device="cpu")
    encoder = SegmentEncoder(model.tokenizer)
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=24, stop_strings=(encoder.prompt_format.answer_stop,))
    cases = list(tqdm(retrieved_cases(HELDOUT_SEED, args.questions, model.tokenizer, num_chunks=args.k),
                      total=args.questions, desc="retrieve", file=sys.stderr))
    variants = [("hypic", int(seam)) for seam in args.seams.split(",") if seam.strip()]
    variants += [(mode.strip(), None) for mode in args.modes.split(",") if mode.strip()]
    started = time.perf_counter()
    reference_answers, reference_logits, requests = [], [], []
    for case in tqdm(cases, desc="full", file=sys.stderr):
        request = Request(list(encoder.prefix()), case.chunk_token_ids, encoder.question(case.question.text))
        requests.append(request)
        reference_logits.append(engine.prefill(request, "full").logits)
        reference_answers.append(engine.generate(request, mode="full", params=params).text.strip())
    rows = {"full": {**summarize([EvalItem(c.question, a) for c, a in zip(cases, reference_answers)]), "kl": 0.0, "agreement": 1.0}}
    for mode, seam in variants:
        label = f"{mode}@{seam}" if seam is not None else mode
        answers, kl = [], 0.0
        for request, logits in tqdm(list(zip(requests, reference_logits)), desc=label, file=sys.stderr):
            kl += float(kl_divergence(logits, engine.prefill(request, mode, seam_tokens=seam).logits))
            answers.append(engine.generate(request, mode=mode, params=params, seam_tokens=seam).text.strip())
        rows[label] = {
            **summarize([EvalItem(c.question, a) for c, a in zip(cases, answers)]),
            "kl": kl / len(cases),
            "agreement": sum(a == b for a, b in zip(answers, reference_answers)) / len(cases),
        }
    report = {"model": str(args.model), "questions": len(cases), "k": args.k, "seconds": round(time.perf_counter() - started, 1),
              "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
