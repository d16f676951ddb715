#!/usr/bin/env python
"""Exact-match benchmark of the bundled default model on held-out synthetic questions.

Held-out worlds start at seed 900,000,000 (training worlds use seeds below 20,000,000 and validation worlds
500,000,000+). Contexts are either the top-k chunks of the real retriever over the question's world
(`--context retriever`: FAISS + the shipped MiniLM embedder, via `hypic_rag.retrieval`) or the gold document(s)
plus random distractor documents of the same world (`--context distractors`).

Modes: `hf` runs transformers' own forward (greedy, its own cache); the others run the runtime's
`Engine.generate` under that mode (`full`, `hypic`, `transition_rope`, `transition`, `addition`, `prefix`).
Every mode sees the same token ids. Output: one JSON object (stdout and `--out`).

    OMP_WAIT_POLICY=PASSIVE python -m evals.eval_default_model --context retriever --modes hf,full,hypic
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

from training.data.synthetic_qa import Question
from hypic_rag.demo.default_model import default_model_path
from training.evaluate import EvalItem, greedy_answer, heldout_cases, summarize
from training.packing import SegmentEncoder
from training.data.synthetic_qa import HELDOUT_SEED

logger = logging.getLogger("eval_default_model")


def build_cases(args: argparse.Namespace, encoder: SegmentEncoder) -> list[tuple[Question, list[list[int]], bool]]:
    """(question, chunk segment ids in prompt order, whether all gold documents are in the context)."""
    if args.context == "retriever":
        from training.heldout_retrieval import retrieved_cases

        return [
            (case.question, case.chunk_token_ids, case.gold_retrieved)
            for case in tqdm(
                retrieved_cases(args.seed, args.questions, encoder.tokenizer, num_chunks=args.k,
                                two_hop_share=args.two_hop_share, hop_slots=args.hop_slots),
                total=args.questions, desc="retrieve", file=sys.stderr,
            )
        ]
    return [
        (question, [encoder.chunk(document.text) for document in documents], True)
        for _, question, documents in heldout_cases(args.seed, args.questions, args.k, args.two_hop_share)
    ]


def run_mode(mode: str, cases, encoder: SegmentEncoder, hf_model, engine) -> tuple[list[EvalItem], float]:
    """Answer every case under `mode`; returns the items and the seconds it took."""
    from hypic_rag.runtime.request import Request
    from hypic_rag.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=24, stop_strings=(encoder.prompt_format.answer_stop,))
    items: list[EvalItem] = []
    started = time.perf_counter()
    for question, chunk_ids, _ in tqdm(cases, desc=mode, file=sys.stderr):
        question_ids = encoder.question(question.text)
        if mode == "hf":
            ids = list(encoder.prefix()) + [t for chunk in chunk_ids for t in chunk] + question_ids
            prediction = greedy_answer(hf_model, encoder, ids)
        else:
            request = Request(prefix_ids=list(encoder.prefix()), chunk_ids=chunk_ids, question_ids=question_ids)
            prediction = engine.generate(request, mode=mode, params=params).text.strip()
        items.append(EvalItem(question, prediction))
    return items, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--k", type=int, default=8, help="chunks per question")
    parser.add_argument("--two-hop-share", type=float, default=0.2)
    parser.add_argument("--hop-slots", type=int, default=2, help="retriever places from one retrieval hop (as the pipeline)")
    parser.add_argument("--context", choices=("retriever", "distractors"), default="retriever")
    parser.add_argument("--modes", default="hf", help="comma-separated: hf,full,hypic,transition_rope,transition,addition")
    parser.add_argument("--seam-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--show-errors", type=int, default=5, help="wrong answers listed per mode")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    encoder = SegmentEncoder(tokenizer)
    hf_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True).eval()
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    engine = None
    if any(mode != "hf" for mode in modes):
        from hypic_rag.runtime.engine import Engine
        from hypic_rag.runtime.model import load_model

        engine = Engine(load_model(hf_model, tokenizer=tokenizer), seam_tokens=args.seam_tokens)

    cases = build_cases(args, encoder)
    gold_in_context = [case[2] for case in cases]
    two_hop_flags = [case[0].hops == 2 for case in cases]
    report: dict = {
        "model": str(args.model),
        "questions": len(cases),
        "seed": args.seed,
        "k": args.k,
        "hop_slots": args.hop_slots if args.context == "retriever" else None,
        "context": args.context,
        "two_hop_share": args.two_hop_share,
        "seam_tokens": args.seam_tokens,
        "gold_recall": sum(gold_in_context) / len(cases),
        "gold_recall_single_hop": _share([g for g, two in zip(gold_in_context, two_hop_flags) if not two]),
        "gold_recall_two_hop": _share([g for g, two in zip(gold_in_context, two_hop_flags) if two]),
        "modes": {},
    }
    for mode in modes:
        items, seconds = run_mode(mode, cases, encoder, hf_model, engine)
        summary = summarize(items)
        summary["seconds"] = round(seconds, 1)
        answered = [item for item, gold in zip(items, gold_in_context) if gold]
        summary["exact_match_when_gold_retrieved"] = summarize(answered)["exact_match"] if answered else float("nan")
        summary["errors"] = [
            {"question": item.question.text, "gold": item.question.answer, "predicted": item.prediction}
            for item in items if not item.exact
        ][: args.show_errors]
        report["modes"][mode] = summary
        logger.info("%s: EM %.3f (single %.3f, two-hop %.3f) in %.0f s", mode, summary["exact_match"],
                    summary["single_hop_exact_match"], summary["two_hop_exact_match"], seconds)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
