"""`hypic-rag ask --index DIR "question"`: retrieve, compose cached chunk states, generate.

Prints the answer, its sources (document, chunk, similarity, opening words) and timings: retrieval, cache load,
compose, prefill and time to first token (measured from the question, retrieval included).
Exit codes: 0 answered; 2 bad input (no index, empty question, missing model); 3 the index was built with
another embedder or model; 1 any other failure.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from hypic_rag.cli.main import CliError
from hypic_rag.cli.precompute_command import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_MISMATCH, EXIT_OK, positive_int
from hypic_rag.runtime.request import MODES

if TYPE_CHECKING:
    from hypic_rag.retrieval.answering import Answer

SNIPPET_CHARACTERS = 80


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ask", help="answer a question over a precomputed index", description=__doc__)
    parser.add_argument("question", metavar="QUESTION", help="the question")
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory made by precompute")
    parser.add_argument("--top-k", type=positive_int, default=4, metavar="K", help="chunks retrieved (4)")
    parser.add_argument("--mode", choices=MODES, default="hypic", help="composition mode (hypic)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N", help="answer length cap (32)")
    parser.add_argument("--model", metavar="PATH", help="model checkpoint (default: the one the index was built for)")
    parser.add_argument("--embedder", metavar="PATH", help="sentence-transformers directory (default: the index's)")
    parser.add_argument("--device", help="model device, e.g. cpu or cuda (default: cuda when available)")
    parser.set_defaults(func=run_ask)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def print_answer(answer: Answer) -> None:
    print(f"Answer: {answer.text}")
    print("Sources:")
    for rank, hit in enumerate(answer.sources, start=1):
        chunk = hit.chunk
        snippet = " ".join(chunk.text.split())
        if len(snippet) > SNIPPET_CHARACTERS:
            snippet = snippet[: SNIPPET_CHARACTERS - 3] + "..."
        print(f"  [{rank}] {chunk.doc_id} #{chunk.position} (score {hit.score:.3f}): {snippet}")
    timings = answer.timings
    print(
        "Timings: "
        + " | ".join(
            f"{label} {_milliseconds(timings[key])}"
            for label, key in (
                ("retrieval", "retrieval"),
                ("cache load", "cache_load"),
                ("compose", "compose"),
                ("prefill", "prefill"),
                ("time to first token", "time_to_first_token"),
            )
        )
    )
    print(
        f"Cache: {answer.cache_hits} segments hit, {answer.cache_misses} encoded "
        f"({_milliseconds(timings['encode'])}); {answer.recomputed_tokens} of {answer.prompt_tokens} prompt tokens "
        "recomputed"
    )


def run_ask(args: argparse.Namespace) -> int:
    from hypic_rag.cache.errors import CacheError
    from hypic_rag.retrieval.answering import AskOptions, IndexAnswerer
    from hypic_rag.retrieval.errors import IndexMismatchError, IndexNotFoundError, RetrievalError

    if not args.question.strip():
        raise CliError("the question is empty", EXIT_BAD_INPUT)
    options = AskOptions(
        top_k=args.top_k,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        model_path=Path(args.model) if args.model else None,
        embedder_path=Path(args.embedder) if args.embedder else None,
        device=args.device,
    )
    try:
        with IndexAnswerer(args.index, options) as answerer:
            answer = answerer.ask(args.question)
    except IndexMismatchError as error:
        raise CliError(str(error), EXIT_MISMATCH) from None
    except IndexNotFoundError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    except (RetrievalError, CacheError) as error:
        raise CliError(str(error), EXIT_FAILURE) from None
    except FileNotFoundError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    print_answer(answer)
    return EXIT_OK
