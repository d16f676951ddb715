"""`hypic-rag ask --index DIR "question"`: answer one question from an index made by precompute.

Prints the answer, its sources in order of similarity to the question (document, chunk, similarity, page or
section, opening words; a chunk found by the retrieval hop is marked `hop`, with a line saying which follow-up
query found it; a chunk the index's neighbour expansion brought is marked `neighbour`, with a line naming the
source that brought it) and timings: retrieval, cache load, compose, prefill and time to first token (measured
from the question, retrieval included); `--timings` adds where the whole run went (start-up, imports, model load,
index open, embedder load, answer, total). `--json` prints one JSON object instead, all of these timings in it.
`ask -` reads the question from standard input. Each `ask` loads the model once for one question; for many
questions run `hypic-rag serve` and ask it over HTTP. Exit codes: 0 answered; 2 bad input (no index, empty
question, missing model); 3 the index was built with another embedder or model; 1 any other failure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    CliError,
    add_index_model_arguments,
    add_neighbours_argument,
    add_recompute_policy_argument,
    number_in,
    process_seconds,
    remote_cache_config,
)
from hypic_rag.utils.limits import HOP_SLOTS, MAX_NEW_TOKENS, MAX_QUESTION_CHARS, TOP_K, question_problem
from hypic_rag.runtime.modes import MODES

if TYPE_CHECKING:
    from hypic_rag.pipeline.answering import Answer, RagPipeline, Source

SNIPPET_CHARACTERS = 80
STDIN_QUESTION = "-"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ask", help="answer one question from an index (for many, use serve)", description=__doc__)
    parser.add_argument("question", metavar="QUESTION", help='the question; "-" reads it from standard input')
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory made by precompute")
    parser.add_argument("--top-k", type=number_in(TOP_K), default=4, metavar="K",
                        help="chunks retrieved (4; 1..256, at most the chunks the index holds)")
    parser.add_argument("--hop-slots", type=number_in(HOP_SLOTS), default=2, metavar="N",
                        help="of the top-k places, how many go to one retrieval hop from the best hit (2; 0: off)")
    parser.add_argument("--mode", choices=MODES, default="hypic", help="composition mode (hypic)")
    add_neighbours_argument(parser)
    add_recompute_policy_argument(parser)
    parser.add_argument("--max-new-tokens", type=number_in(MAX_NEW_TOKENS), default=32, metavar="N",
                        help="answer length cap (32; 1..65536)")
    add_index_model_arguments(parser)
    parser.add_argument("--embedder", metavar="PATH", help="sentence-transformers directory (default: the index's)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: question, answer, sources (by score), usage, timings (seconds, "
                             "the whole run's included), note")
    parser.add_argument("--timings", action="store_true",
                        help="also print where the whole run's time went: start-up, imports, model load, index and "
                             "embedder, answer")
    parser.set_defaults(func=run_ask)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def location_label(metadata: dict[str, Any]) -> str:
    """"page 3", "pages 3-4" or "section Guide > Setup" from a source's metadata; "" when it has neither."""
    if "page" in metadata:
        end = metadata.get("page_end")
        return f"pages {metadata['page']}-{end}" if end is not None else f"page {metadata['page']}"
    if "section" in metadata:
        return f"section {metadata['section']}"
    return ""


def neighbour_note(source: Source, sources: Sequence[Source]) -> str:
    """The line under a source the index's neighbour expansion brought (`source.neighbour_of` set; `sources` the
    answer's, best first): which source brought it, by rank and chunk id, and that the question did not."""
    found = [(rank, other) for rank, other in enumerate(sources, start=1) if other.chunk_id == source.neighbour_of]
    if not found:  # the bringer is not among the sources: named by its chunk id alone
        return f"neighbour: brought by chunk {source.neighbour_of} of its document, not by the question"
    rank, bringer = found[0]
    side = "after" if source.position > bringer.position else "before"
    return (f"neighbour: the chunk {side} [{rank}] {bringer.doc_id} #{bringer.position} in its document, brought by "
            f"that hit (chunk {bringer.chunk_id}), not by the question")


def print_answer(answer: Answer) -> None:
    print(f"Answer: {answer.text}")
    if answer.note:
        print(answer.note)
    print("Sources (by similarity to the question):")
    for rank, source in enumerate(answer.sources, start=1):
        snippet = " ".join(source.text.split())
        if len(snippet) > SNIPPET_CHARACTERS:
            snippet = snippet[: SNIPPET_CHARACTERS - 3] + "..."
        notes = ", ".join(note for note in (f"score {source.score:.3f}", location_label(source.metadata),
                                            "hop" if source.hop_query is not None else "",
                                            "neighbour" if source.neighbour_of is not None else "") if note)
        print(f"  [{rank}] {source.doc_id} #{source.position} ({notes}): {snippet}")
        if source.hop_query is not None:
            print(f"      hop: found by the follow-up query {json.dumps(source.hop_query, ensure_ascii=False)}, made "
                  f"from the best hit's sentences (score {source.hop_score or 0.0:.3f} against it), not by the question")
        if source.neighbour_of is not None:
            print(f"      {neighbour_note(source, answer.sources)}")
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
        + (f" (recompute policy {answer.recompute_policy})" if answer.recompute_policy else "")
    )


def answer_json(question: str, answer: Answer) -> dict[str, Any]:
    """The `--json` object: question, answer, mode, finish reason, sources best first (the fields every surface
    writes, `hypic_rag.pipeline.vocabulary.SOURCE_FIELDS`), usage and timings (seconds)."""
    return {"question": question, **answer.as_dict()}


def read_question(given: str) -> str:
    """The question: `given`, or standard input's text when `given` is "-" (read up to one character past the
    limit, whatever standard input holds); a CliError when it is empty, longer than `MAX_QUESTION_CHARS` or not
    valid Unicode (argv bytes that are not UTF-8 arrive as lone surrogates), checked before any model loads."""
    if given != STDIN_QUESTION:
        problem = question_problem(given)
        if problem is not None:
            raise CliError(f"the question {problem}", EXIT_BAD_INPUT)
        return given
    if sys.stdin is None:
        raise CliError('"-" reads the question from standard input, but there is none', EXIT_BAD_INPUT)
    try:
        question = sys.stdin.read(MAX_QUESTION_CHARS + 1)
    except UnicodeDecodeError:
        raise CliError("standard input is not UTF-8 text", EXIT_BAD_INPUT) from None
    if len(question) > MAX_QUESTION_CHARS:
        raise CliError(f"the question on standard input has more than {MAX_QUESTION_CHARS} characters; at most "
                       f"{MAX_QUESTION_CHARS} are accepted", EXIT_BAD_INPUT)
    if not question.strip():
        raise CliError('standard input is empty: "-" reads the question from it (echo "question" | hypic-rag ask '
                       "--index DIR -)", EXIT_BAD_INPUT)
    problem = question_problem(question)
    if problem is not None:
        raise CliError(f"the question on standard input {problem}", EXIT_BAD_INPUT)
    return question.strip()


def open_pipeline(args: argparse.Namespace) -> RagPipeline:
    """The index (checked against the embedder and model), its model, its segment cache, as one pipeline."""
    from hypic_rag.pipeline.answering import RagPipeline

    return RagPipeline.open(args.index, model_path=args.model, embedder_path=args.embedder, device=args.device,
                            hop_slots=args.hop_slots, dtype=args.dtype, remote_cache=remote_cache_config(args),
                            recompute_policy=args.recompute_policy, cache_format=args.cache_format,
                            neighbours=args.neighbours)


def run_ask(args: argparse.Namespace) -> int:
    """Errors of the index, model, cache or pipeline reach `hypic_rag.cli.main` as they are (each carries its
    exit code)."""
    run_timings = {"startup": process_seconds()}  # the interpreter and the command line, up to here
    question = read_question(args.question)
    began = time.perf_counter()
    import hypic_rag.pipeline.answering  # noqa: F401  (torch and the runtime; transformers' model code loads with the model)
    from hypic_rag.runtime.sampling import SamplingParams

    run_timings["imports"] = time.perf_counter() - began
    pipeline = open_pipeline(args)
    run_timings.update(pipeline.open_timings)
    try:
        began = time.perf_counter()
        params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_strings=(pipeline.prompt_format.answer_stop,))
        answer = pipeline.answer(question, top_k=args.top_k, mode=args.mode, params=params)
        run_timings["answer"] = time.perf_counter() - began
    finally:
        pipeline.close()
    run_timings["run_total"] = process_seconds()
    run_timings = {name: seconds for name, seconds in run_timings.items() if seconds is not None}
    if args.json:
        data = answer_json(question, answer)
        data["timings"].update(run_timings)
        print(json.dumps(data, ensure_ascii=False))
    else:
        print_answer(answer)
        if args.timings:
            print(run_timings_line(run_timings))
    return EXIT_OK


RUN_PHASES = (
    ("start-up", "startup"),
    ("imports", "imports"),
    ("model load", "model_load"),
    ("index open", "index_open"),
    ("embedder load", "embedder_load"),
    ("answer", "answer"),
    ("total", "run_total"),
)
"""The whole run's phases `--timings` prints (label, key in the `--json` timings)."""


def run_timings_line(run_timings: dict[str, float]) -> str:
    """'Run: start-up 0.21 s | imports 1.02 s | ... | total 3.10 s' (phases measured only)."""
    return "Run: " + " | ".join(f"{label} {run_timings[key]:.2f} s" for label, key in RUN_PHASES if key in run_timings)
