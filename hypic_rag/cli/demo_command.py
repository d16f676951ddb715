"""`hypic-rag demo`: see it work in a minute, on the bundled demo model and example corpus.

Indexes the bundled example corpus (short documents about invented people, places and companies) into an index and
segment cache under the user cache directory (once, with progress), then answers a handful of the corpus's
questions, printing each answer with its sources and the time to first token under `full` (the whole prompt
recomputed) and `hypic` (cached chunk states composed) side by side. The bundled model is a small demo that knows
only this synthetic world; for your own documents use `precompute` and `ask` with `--model PATH`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_MISMATCH,
    EXIT_OK,
    CliError,
    int_in,
    number_in,
    resolve_model_path,
)
from hypic_rag.utils.limits import HOP_SLOTS, TOP_K


DEMO_INTRODUCTION = (
    "hypic-rag demo: indexes the bundled example corpus ({documents} documents about invented people and places) "
    "with the bundled demo model, then answers {questions} of its questions twice, `full` (whole prompt recomputed) "
    "and `hypic` (cached chunk states composed), with sources and time to first token."
)
"""The demo's first line: what it does."""


def user_cache_dir() -> Path:
    base = os.environ.get("HYPIC_RAG_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / ("" if os.environ.get("HYPIC_RAG_CACHE") else "hypic-rag")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="try it: index the bundled example and answer a few questions (full vs hypic)", description=__doc__)
    parser.add_argument("--index", metavar="DIR", help="index directory (default: <user cache>/demo-index)")
    parser.add_argument("--questions", type=int_in(1, 1_000), default=6, metavar="N",
                        help="questions answered (6; 1..1000)")
    parser.add_argument("--top-k", type=number_in(TOP_K), default=8, metavar="K", help="chunks retrieved per question (8)")
    parser.add_argument("--hop-slots", type=number_in(HOP_SLOTS), default=2, metavar="N",
                        help="of the top-k places, how many go to one retrieval hop from the best hit (2; 0: off)")
    parser.add_argument("--model", metavar="PATH", help="model checkpoint (default: the bundled model)")
    parser.set_defaults(func=run_demo)


def _load_questions(path: Path, count: int) -> list[dict]:
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    single = [q for q in questions if q.get("hops", 1) == 1]
    double = [q for q in questions if q.get("hops", 1) == 2]
    picked = single[: max(1, count - count // 3)] + double[: count // 3]
    return picked[:count]


def run_demo(args: argparse.Namespace) -> int:
    """Errors of the index, model, cache or pipeline reach `hypic_rag.cli.main` as they are (each carries its exit
    code: 2 bad input, 3 a mismatched index, 1 otherwise)."""
    from hypic_rag.demo.default_model import example_corpus_path

    model_path = resolve_model_path(args.model)
    corpus = example_corpus_path()
    if not (corpus / "documents").is_dir():
        raise CliError(f"the bundled example corpus is missing at {corpus}; reinstall hypic-rag", EXIT_BAD_INPUT)
    index_dir = Path(args.index).expanduser() if args.index else user_cache_dir() / "demo-index"
    documents = sum(1 for _ in (corpus / "documents").glob("*.md"))
    print(DEMO_INTRODUCTION.format(documents=documents, questions=args.questions))
    print(f"model: {model_path}")
    print(f"index and segment cache: {index_dir} (built once; delete it to rebuild)", flush=True)
    # the heavy imports (torch, transformers) after the introduction, which shows at once
    from hypic_rag.pipeline.answering import RagPipeline
    from hypic_rag.pipeline.precompute import PrecomputeOptions, precompute
    from hypic_rag.retrieval.errors import IndexMismatchError
    from hypic_rag.runtime.sampling import SamplingParams
    options = PrecomputeOptions(corpus=corpus / "documents", index_dir=index_dir, model_path=model_path)
    try:
        summary = precompute(options)
    except IndexMismatchError as error:
        if args.index:
            raise CliError(f"{error}; pass another --index or delete this one", EXIT_MISMATCH) from None
        print(f"the demo index was built for another model or settings; rebuilding it ({error})")
        shutil.rmtree(index_dir)
        summary = precompute(options)
    if summary.did_work:
        print(
            f"precomputed {summary.chunks} chunks ({summary.tokens} tokens) of {summary.documents} documents "
            f"in {summary.elapsed_seconds:.1f} s; cache {summary.cache_bytes / 2**20:.1f} MiB"
        )
    pipeline = RagPipeline.open(index_dir, model_path=model_path, hop_slots=args.hop_slots)
    params = SamplingParams(max_new_tokens=24, stop_strings=(pipeline.prompt_format.answer_stop,))
    correct = {"full": 0, "hypic": 0}
    ttft = {"full": 0.0, "hypic": 0.0}
    questions = _load_questions(corpus / "questions.jsonl", args.questions)
    try:
        # one untimed question first: lazy initialisation (embedder, kernels, allocator) is not time to first token
        for mode in ("full", "hypic"):
            pipeline.answer(questions[0]["text"], top_k=args.top_k, mode=mode, params=SamplingParams(max_new_tokens=1))
        for number, question in enumerate(questions, start=1):
            answers = {mode: pipeline.answer(question["text"], top_k=args.top_k, mode=mode, params=params) for mode in ("full", "hypic")}
            print(f"\n[{number}] {question['text']}  (gold: {question['answer']})")
            for mode, answer in answers.items():
                ok = answer.text.strip() == question["answer"]
                correct[mode] += ok
                ttft[mode] += answer.timings["time_to_first_token"]
                print(
                    f"  {mode:5s} -> {answer.text!r:32s} {'correct' if ok else 'wrong':7s} "
                    f"TTFT {answer.timings['time_to_first_token'] * 1000:7.1f} ms, "
                    f"{answer.usage['recomputed_tokens']}/{answer.usage['prompt_tokens']} tokens recomputed"
                )
            sources = answers["hypic"].sources[:3]
            print("  sources: " + ", ".join(f"{s.doc_id} ({s.score:.2f})" for s in sources))
    finally:
        pipeline.close()
    count = len(questions)
    print(
        f"\nexact match: full {correct['full']}/{count}, hypic {correct['hypic']}/{count}; "
        f"mean TTFT full {ttft['full'] / count * 1000:.1f} ms vs hypic {ttft['hypic'] / count * 1000:.1f} ms "
        f"({ttft['full'] / max(ttft['hypic'], 1e-9):.1f}x)"
    )
    return EXIT_OK
