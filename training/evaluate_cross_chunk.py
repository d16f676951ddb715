"""Held-out exact match of a checkpoint on the cross-chunk worlds under `full` (transformers' own forward, every
token attended): the evaluation shipped as `evals/cross_chunk_model/evaluation.json`.

Two contexts per question: *gold* (the question's chunks and distractor documents, as training draws them:
`sample_cross_chunk_context`) and *retrieved* (the real retriever's top k = 8 over the world's index, laid out as the
pipeline lays them out: `heldout_retrieval.retrieved_cross_chunk_cases`, each world's index built with the
retrieval a new index gets, `chunk_context.DEFAULT_RETRIEVAL`, unless `--embedding-context` / `--neighbours` say
otherwise). EM overall, on cross-chunk and single-chunk questions, and on retrieved contexts also where every
needed chunk was retrieved. `--keep-gold` keeps the gold-context part of an existing `--out` report (it does not
depend on retrieval) and measures the retrieved contexts only.

    OMP_WAIT_POLICY=PASSIVE python -m training.evaluate_cross_chunk --model evals/cross_chunk_model \\
        --questions 200 --out evals/cross_chunk_model/evaluation.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from training.data.cross_chunk_qa import sample_cross_chunk_context
from training.evaluate import EvalItem, greedy_answer, prompt_ids
from training.packing import SegmentEncoder

HELDOUT_GOLD_SEED = 912_000_000
"""Worlds of the gold-context questions (held out: training < 40,000,000, validation 501,000,000+)."""
HELDOUT_RETRIEVED_SEED = 913_000_000
"""Worlds of the retrieved-context questions."""


def exact_shares(items: Sequence[tuple[Any, bool]]) -> dict[str, Any]:
    """(case or question, exact) pairs -> questions and EM overall and per question kind."""
    def share(selected: list[bool]) -> float | None:
        return sum(selected) / len(selected) if selected else None

    kind = lambda item: getattr(getattr(item, "question", item), "kind", "single")  # noqa: E731
    return {"questions": len(items), "exact_match": share([exact for _, exact in items]),
            "cross_exact_match": share([exact for item, exact in items if kind(item) == "cross"]),
            "single_exact_match": share([exact for item, exact in items if kind(item) == "single"])}


@torch.no_grad()
def evaluate(model_dir: Path, questions: int, k: int = 8, *, retrieval: Any = None,
             gold_report: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of `model_dir` on `questions` gold-context and `questions` retrieved-context questions.
    retrieval: the worlds' indexes' `RetrievalSettings` (None: `DEFAULT_RETRIEVAL`); gold_report: a stored
    gold-context part to keep instead of measuring it again."""
    from hypic_rag.retrieval.chunk_context import DEFAULT_RETRIEVAL
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM

    from training.heldout_retrieval import retrieved_cross_chunk_cases

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen3_5ForCausalLM.from_pretrained(model_dir).eval()
    encoder = SegmentEncoder(tokenizer)
    began = time.perf_counter()
    gold: list[tuple[Any, bool]] = []
    seed = HELDOUT_GOLD_SEED
    with tqdm(total=0 if gold_report else questions, desc="gold contexts", file=sys.stderr) as progress:
        while len(gold) < questions and gold_report is None:
            chunks, asked = sample_cross_chunk_context(seed, 5, 2)
            for question in asked[: questions - len(gold)]:
                answer = greedy_answer(model, encoder, prompt_ids(encoder, chunks, question.text))
                gold.append((question, EvalItem(question, answer).exact))
                progress.update(1)
            seed += 1
    retrieved: list[tuple[Any, bool]] = []
    retrieval = retrieval or DEFAULT_RETRIEVAL
    for case in tqdm(retrieved_cross_chunk_cases(HELDOUT_RETRIEVED_SEED, questions, tokenizer, num_chunks=k,
                                                 retrieval=retrieval),
                     total=questions, desc="retrieved contexts", file=sys.stderr):
        ids = list(encoder.prefix()) + [token for chunk in case.chunk_token_ids for token in chunk] \
            + encoder.question(case.question.text)
        retrieved.append((case, EvalItem(case.question, greedy_answer(model, encoder, ids)).exact))
    found = [(case, exact) for case, exact in retrieved if case.needed_retrieved]
    return {
        "model": str(model_dir), "mode": "full (transformers forward)", "k": k,
        "gold_context": gold_report or {"seed": HELDOUT_GOLD_SEED, **exact_shares(gold)},
        "retrieved_context": {
            "seed": HELDOUT_RETRIEVED_SEED, "retrieval": retrieval.to_dict(), **exact_shares(retrieved),
            "needed_recall": exact_shares([(case, case.needed_retrieved) for case, _ in retrieved]),
            "when_needed_retrieved": exact_shares(found),
        },
        "seconds": round(time.perf_counter() - began, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--embedding-context", default=None,
                        help="the worlds' indexes' embedding context (default: a new index's)")
    parser.add_argument("--neighbours", default=None, help="their neighbour expansion, KIND:SLOTS (default: a new index's)")
    parser.add_argument("--keep-gold", action="store_true",
                        help="keep the gold-context part of the existing --out report; measure retrieved contexts only")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(args.threads)
    from dataclasses import replace

    from hypic_rag.retrieval.chunk_context import DEFAULT_RETRIEVAL

    retrieval = DEFAULT_RETRIEVAL.with_neighbours(args.neighbours)
    if args.embedding_context is not None:
        retrieval = replace(retrieval, embedding_context=args.embedding_context)
    gold = json.loads(args.out.read_text())["gold_context"] if args.keep_gold and args.out else None
    report = evaluate(args.model, args.questions, retrieval=retrieval, gold_report=gold)
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
