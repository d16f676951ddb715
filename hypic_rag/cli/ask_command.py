"""`hypic-rag ask --index DIR "question"`: retrieve, compose cached chunk states, generate.

Prints the answer, its sources (document, chunk, similarity, opening words) and timings: retrieval, cache load,
compose, prefill and time to first token (measured from the question, retrieval included).
Exit codes: 0 answered; 2 bad input (no index, empty question, missing model); 3 the index was built with
another embedder or model; 1 any other failure.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hypic_rag.cli.main import CliError
from hypic_rag.cli.precompute_command import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_MISMATCH,
    EXIT_OK,
    device_name,
    non_negative_int,
    positive_int,
)
from hypic_rag.runtime.request import MODES

if TYPE_CHECKING:
    from hypic_rag.pipeline import Answer, RagPipeline

SNIPPET_CHARACTERS = 80


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ask", help="answer a question over a precomputed index", description=__doc__)
    parser.add_argument("question", metavar="QUESTION", help="the question")
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory made by precompute")
    parser.add_argument("--top-k", type=positive_int, default=4, metavar="K",
                        help="chunks retrieved (4; at most the chunks the index holds)")
    parser.add_argument("--hop-slots", type=non_negative_int, default=2, metavar="N",
                        help="of the top-k places, how many go to one retrieval hop from the best hit (2; 0: off)")
    parser.add_argument("--mode", choices=MODES, default="hypic", help="composition mode (hypic)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="answer length cap (32)")
    parser.add_argument("--model", metavar="PATH", help="model checkpoint (default: the one the index was built for)")
    parser.add_argument("--embedder", metavar="PATH", help="sentence-transformers directory (default: the index's)")
    parser.add_argument("--device", type=device_name, help="model device, e.g. cpu or cuda (default: cuda when available)")
    parser.set_defaults(func=run_ask)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def print_answer(answer: Answer) -> None:
    print(f"Answer: {answer.text}")
    print("Sources:")
    for rank, source in enumerate(answer.sources, start=1):
        snippet = " ".join(source.text.split())
        if len(snippet) > SNIPPET_CHARACTERS:
            snippet = snippet[: SNIPPET_CHARACTERS - 3] + "..."
        print(f"  [{rank}] {source.doc_id} #{source.position} (score {source.score:.3f}): {snippet}")
    timings = answer.timings
    print(
        "Timings: "
        + " | ".join(
            f"{label} {_milliseconds(timings.get(key, 0.0))}"
            for label, key in (
                ("retrieval", "retrieval"),
                ("cache load", "cache_load"),
                ("compose", "compose"),
                ("prefill", "prefill"),
                ("time to first token", "time_to_first_token"),
            )
        )
    )
    usage = answer.usage
    print(
        f"Cache: {usage.get('cache_hits', 0)} segments hit, {usage.get('cache_misses', 0)} encoded "
        f"({_milliseconds(timings.get('encode', 0.0))}); {usage.get('recomputed_tokens', 0)} of "
        f"{usage.get('prompt_tokens', 0)} prompt tokens recomputed"
    )


def open_pipeline(args: argparse.Namespace) -> RagPipeline:
    """The index (checked against the embedder and model), its model, its segment cache, as one pipeline."""
    from hypic_rag.pipeline import RagPipeline

    return RagPipeline.open(args.index, model_path=args.model, embedder_path=args.embedder, device=args.device,
                            hop_slots=args.hop_slots)


def run_ask(args: argparse.Namespace) -> int:
    from hypic_rag.cache.errors import CacheError
    from hypic_rag.pipeline import PipelineError
    from hypic_rag.retrieval.errors import IndexLocationError, IndexMismatchError, IndexNotFoundError, RetrievalError
    from hypic_rag.runtime.engine import SamplingParams

    if not args.question.strip():
        raise CliError("the question is empty", EXIT_BAD_INPUT)
    try:
        pipeline = open_pipeline(args)
        try:
            params = SamplingParams(
                max_new_tokens=args.max_new_tokens, stop_strings=(pipeline.prompt_format.answer_stop,)
            )
            answer = pipeline.answer(args.question, top_k=args.top_k, mode=args.mode, params=params)
        finally:
            pipeline.close()
    except IndexMismatchError as error:
        raise CliError(str(error), EXIT_MISMATCH) from None
    except (IndexNotFoundError, IndexLocationError, PipelineError, FileNotFoundError) as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    except (RetrievalError, CacheError) as error:
        raise CliError(str(error), EXIT_FAILURE) from None
    print_answer(answer)
    return EXIT_OK
