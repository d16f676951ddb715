"""`hypic-rag precompute CORPUS --index DIR [--model PATH]`: index your documents for `ask` and `serve`.

Reads every document (.txt, .md, .jsonl, .pdf, .html, .docx), cuts it into chunks, embeds them for retrieval (FAISS)
and encodes every chunk once with the model into the segment cache. Without --model it uses the bundled demo model,
which knows only a synthetic world: it says so in one line when your documents are not that world.

Resumable: interrupted and rerun, it finishes what is left; rerun on an unchanged corpus it does nothing.
With --ray the corpus is loaded, chunked and embedded by Ray tasks and encoded on Ray actors, longest batches
first; this process stays the index's single writer, so the result is the same index and byte-identical cache
entries as a local run, and a killed run resumes the same way. With --ray and --remote-cache the actors write
their entries straight to the remote tier (the same keys and bytes), and only the index goes through this process.
Exit codes: 0 done; 2 bad input (missing or empty corpus, missing model, bad option, an --index or --cache that
is a file or not writable: checked before anything is created; Ray missing or unreachable with --ray); 3 the index was built with another embedder,
model, tokenizer, chunker setting or --cache; 1 any other failure (unreadable index or cache).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    CliError,
    add_cache_format_argument,
    add_dtype_argument,
    add_remote_cache_arguments,
    device_name,
    int_in,
    neighbours_spec,
    number_in,
    recompute_policy_spec,
    remote_cache_config,
    resolve_model_path,
    worker_count,
)
from hypic_rag.retrieval.chunk_context import DEFAULT_RETRIEVAL, EMBEDDING_CONTEXTS
from hypic_rag.retrieval.loading import FORMATS_NOTE
from hypic_rag.utils.limits import CHUNK_TOKENS, SEAM_TOKENS

if TYPE_CHECKING:
    from hypic_rag.pipeline.precompute import PrecomputeSummary

VECTOR_INDEX_KINDS = ("flat", "hnsw", "ivf")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "precompute", help="index your documents and encode every chunk into the cache (once per corpus)",
        description=__doc__
    )
    parser.add_argument("corpus", metavar="CORPUS",
                        help=f"a directory, searched recursively for {FORMATS_NOTE} files (others and hidden ones "
                             f"are ignored), or one file (another suffix is read as plain text); a file that cannot "
                             f"be read is named in a warning and in the summary")
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory (created if absent)")
    parser.add_argument("--model", metavar="PATH", help="local model checkpoint (default: the bundled default model)")
    parser.add_argument("--chunk-tokens", type=number_in(CHUNK_TOKENS), default=256, metavar="N",
                        help="tokens per chunk (256; 1..65536)")
    parser.add_argument("--embedding-context", choices=EMBEDDING_CONTEXTS, default=None,
                        help="what each chunk is embedded with besides its text (its cached tokens stay its own): "
                             "title (the document's title and section), document_head (title + the document's "
                             f"first sentence), previous_tail (title + the previous chunk's last sentence), none; "
                             f"default: an existing index's, else {DEFAULT_RETRIEVAL.embedding_context}")
    parser.add_argument("--neighbours", type=neighbours_spec, metavar="KIND[:SLOTS]",
                        help="the neighbour expansion the index records for ask / serve / calibrate: each retrieved "
                             "chunk brings its document's next / previous / both chunks into the top-k places, at "
                             f"most SLOTS of them; default: an existing index's, else {DEFAULT_RETRIEVAL.neighbours_spec}")
    parser.add_argument("--workers", type=worker_count(), default=1, metavar="N", help="encoding processes (1)")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help="run on a Ray cluster: load, chunk and embed as tasks, encode on actors; ADDRESS is "
                             "'auto' (the cluster on this machine), host:port or ray://host:port; without one a "
                             "private Ray instance is started here (needs the ray extra)")
    parser.add_argument("--ray-actors", type=int_in(1, 4_096), default=None, metavar="N",
                        help="encoding actors with --ray (default: one per GPU of the cluster, or per CPU slot)")
    parser.add_argument("--seam-tokens", type=number_in(SEAM_TOKENS), default=8, metavar="W",
                        help="seam window (8; 0..65536)")
    parser.add_argument("--vector-index", choices=VECTOR_INDEX_KINDS, help="FAISS index kind for a new index (flat)")
    parser.add_argument("--cache", metavar="DIR", help="segment cache directory (default: DIR/segment_cache)")
    parser.add_argument("--embedder", metavar="PATH", help="local sentence-transformers directory (default: bundled)")
    parser.add_argument("--device", type=device_name,
                        help="model device, e.g. cpu or cuda (default: cuda when available)")
    add_dtype_argument(parser, "default: the index's; for a new one float32 on CPU, bfloat16 on CUDA")
    add_cache_format_argument(parser, "default: the index's, float32 for a new one; another than the index's "
                                      "rebuilds its cache in that format")
    add_remote_cache_arguments(parser)
    parser.add_argument("--recompute-policy", type=recompute_policy_spec, metavar="SPEC",
                        help="the policy whose entries are encoded (anchored ones for +anchored, chained ones too for "
                             "+chained); default: the index's calibrated policy (hypic-rag calibrate), else seam")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_precompute)


def print_summary(summary: PrecomputeSummary) -> None:
    """The closing report: documents, chunks, tokens, cache bytes, elapsed, throughput."""
    from hypic_rag.utils.units import human_bytes

    ingest, encode = summary.ingest, summary.encode
    print(
        f"documents: {summary.documents} ({ingest.documents_added} added, {ingest.documents_updated} updated, "
        f"{ingest.documents_unchanged} unchanged, {ingest.documents_deleted} deleted)"
    )
    print(f"chunks: {summary.chunks} ({ingest.chunks_added} added, {ingest.chunks_removed} removed)")
    print(f"tokens: {summary.tokens}")
    if summary.skipped:
        print(f"skipped: {len(summary.skipped)} inputs")
        for skipped in summary.skipped:
            print(f"  {skipped}")
    print(
        f"encoded: {encode.encoded} of {encode.segments} segments, {encode.tokens_encoded} tokens "
        f"in {encode.seconds:.2f} s ({encode.tokens_per_second:.0f} tokens/s)"
    )
    stored_remotely = (f" (and {encode.stored_remotely} entries the encoding actors wrote to the remote tier only)"
                       if encode.stored_remotely else "")
    print(f"cache: {human_bytes(summary.cache_bytes)} in {summary.cache_dir}{stored_remotely}")
    if summary.rebuilt_from is not None:
        print(f"cache format: {summary.cache_format}, rebuilt from {summary.rebuilt_from} "
              f"({summary.removed_entries} entries of {summary.rebuilt_from} removed)")
    else:
        print(f"cache format: {summary.cache_format}")
    if summary.remote is not None:
        print(remote_summary_line(summary.remote))
    overall = summary.tokens / summary.elapsed_seconds if summary.elapsed_seconds > 0 else 0.0
    print(f"elapsed: {summary.elapsed_seconds:.2f} s ({overall:.0f} corpus tokens/s)")
    if not summary.did_work:
        print("index is up to date: nothing embedded, indexed or encoded")
    if summary.note:
        print(summary.note)


def remote_summary_line(remote: dict[str, Any]) -> str:
    """'remote: s3://... 12 uploaded (1.2 GiB), 3 already there, 0 dropped' (and the last error, if any)."""
    from hypic_rag.utils.units import human_bytes

    by_encoders = (f", {remote['remote_puts_by_encoders']} of them by the encoding actors"
                   if "remote_puts_by_encoders" in remote else "")
    line = (f"remote: {remote['remote_url']}: {remote['remote_puts']} uploaded "
            f"({human_bytes(remote['remote_bytes_written'])}{by_encoders}), {remote['remote_puts_skipped']} already "
            f"there, {remote['remote_puts_dropped']} dropped")
    if remote.get("remote_last_error"):
        line += f" (the remote is failing: {remote['remote_last_error']})"
    return line


def run_precompute(args: argparse.Namespace) -> int:
    """Paths are checked before the corpus is read, the corpus before a model loads, all before anything is
    created. Errors reach `hypic_rag.cli.main` as they are (each carries its exit code)."""
    from hypic_rag.retrieval.faiss_index import VectorIndexConfig
    from hypic_rag.retrieval.loading import load_corpus
    from hypic_rag.pipeline.precompute import PrecomputeConfig, check_locations, precompute

    if args.ray is not None and args.workers > 1:
        raise CliError("--workers and --ray exclude each other (with --ray, --ray-actors sets the encoders)")
    if args.ray_actors is not None and args.ray is None:
        raise CliError("--ray-actors needs --ray")
    if args.workers > 1 or args.ray is not None:  # the processes this run starts end with it, however it ends
        from hypic_rag.utils.reaper import reap_on_exit

        reap_on_exit()
    check_locations(Path(args.index), Path(args.cache) if args.cache else None)  # before anything is created
    remote = remote_cache_config(args)
    scale_out = None
    if args.ray is None:
        corpus = load_corpus(args.corpus)  # a missing or empty corpus fails before any model loads
    else:  # Ray is imported only here: an unreachable cluster fails before anything loads
        from hypic_rag.distributed.ray_scale_out import RayScaleOut

        try:
            scale_out = RayScaleOut(address=args.ray, actors=args.ray_actors)
        except ValueError as error:
            raise CliError(str(error)) from None
        corpus = scale_out.load_corpus(Path(args.corpus))
    model_path = resolve_model_path(args.model)
    try:
        options = PrecomputeConfig(
            corpus=Path(args.corpus),
            index_dir=Path(args.index),
            model_path=model_path,
            chunk_tokens=args.chunk_tokens,
            workers=args.workers,
            seam_tokens=args.seam_tokens,
            vector_index=VectorIndexConfig(kind=args.vector_index) if args.vector_index else None,
            cache_dir=Path(args.cache) if args.cache else None,
            embedder_path=Path(args.embedder) if args.embedder else None,
            device=args.device,
            dtype=args.dtype,
            show_progress=not args.no_progress,
            remote_cache=remote,
            scale_out=scale_out,
            cache_format=args.cache_format,
            recompute_policy=args.recompute_policy,
            embedding_context=args.embedding_context,
            neighbours=args.neighbours,
        )
    except ValueError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    print_summary(precompute(options, corpus=corpus))
    return EXIT_OK
