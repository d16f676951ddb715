"""`hypic-rag serve --index DIR [--host 127.0.0.1] [--port 8000]`: the REST service over a precomputed index.

Endpoints: POST /v1/ask, POST /v1/completions (OpenAI-compatible; segments separated by <<PIC_SEP>>),
POST /v1/documents, GET /v1/jobs/{id}, DELETE /v1/documents/{id}, GET /v1/cache/stats, GET /healthz,
GET /metrics, the OpenAPI page at /docs, and a page to ask from at / (its assets under /ui/; --no-ui: none). SIGINT or SIGTERM shut down gracefully (in-flight requests finish,
the cache is closed cleanly). Start-up binds the port first, then loads the model, so a port in use fails at once.
Processes and threads: on a CPU with at least 2 cores and a model whose weights are at most 64 MiB (the bundled
model), the model runs in one worker process per core this process may use (os.sched_getaffinity; at most 8), each
with cores // workers intra-op threads, behind this endpoint, each request sent to the least loaded; otherwise (a
larger model, one core, a GPU) in this one process with every core's threads. The log names the choice and why;
--workers N and --threads N override it. Over a writable index worker-0 owns the index: the front sends it every
document route, the other workers follow its writes (a document is found by every worker once its job reports it
indexed), and while it has document jobs pending, questions go to the other workers while one has room. With
--replicas N the model runs in N Ray Serve
replicas (read-only) behind this endpoint: the same API, each request routed to the replica likely to hold its
retrieved chunks hot (rendezvous hashing, load as tie-break); /v1/cache/stats and /healthz report every replica.
--encode-actors K encodes cache misses on K Ray actors.
With --remote-cache every replica reads and writes the shared remote tier (an entry one replica encodes is a hit
on the others); --cache DIR/{replica} gives each replica a local cache of its own.
API keys: --api-key KEY (or the environment variable HYPIC_RAG_API_KEY, which keeps the key out of the process
list) makes every route need the header 'Authorization: Bearer KEY' (401 without it), except /healthz, /metrics
(unless --metrics-need-key), the OpenAPI page (/docs, /openapi.json) and the web page (/, /ui/...). One key gives
full access; with --admin-key ADMIN (or HYPIC_RAG_ADMIN_KEY) document changes (POST and DELETE /v1/documents)
need ADMIN, and the API key gets 403 there. Keys are compared in constant time and never logged. Binding an
address other than loopback (e.g. --host 0.0.0.0) without a key is refused (exit 2) unless --allow-no-key.
Exit codes: 0 after a clean shutdown; 2 bad input (no index, missing model, bad option); 3 the index was built
for another model or tokenizer; 1 the server could not start (port in use, another process writes the index:
stop it or pass --read-only, unreadable index or cache). Each failure prints one line.
"""

from __future__ import annotations

import argparse
import errno
import logging
from pathlib import Path

from hypic_rag.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_OK,
    CliError,
    add_index_model_arguments,
    add_neighbours_argument,
    add_recompute_policy_argument,
    int_in,
    number_in,
    remote_cache_config,
    seconds_in,
)
from hypic_rag.errors import HypicError
from hypic_rag.utils.limits import HOP_SLOTS, NumberRange

logger = logging.getLogger(__name__)


DAY_S = 86_400.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve an index over HTTP (ask, OpenAI completions, documents)", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--index", required=True, metavar="DIR", help="index directory made by precompute")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    parser.add_argument("--port", type=int_in(0, 65_535), default=8000, help="port to bind (8000; 0 picks a free one)")
    add_index_model_arguments(parser)
    parser.add_argument("--cache", metavar="DIR",
                        help="segment cache directory (default: the index's), e.g. a local disk when the index lies "
                             "on a shared file system; with --replicas, {replica} in DIR becomes each replica's name")
    parser.add_argument("--hop-slots", type=number_in(HOP_SLOTS), default=2, metavar="N",
                        help="of each question's top_k places, how many go to one retrieval hop from the best hit (2; 0: off)")
    add_neighbours_argument(parser)
    add_recompute_policy_argument(parser)
    parser.add_argument("--read-only", action="store_true", help="search only: refuse document changes")
    parser.add_argument("--no-ui", dest="page", action="store_false",
                        help="do not serve the page to ask from at / (and /ui/); the JSON API is the same")
    parser.add_argument("--retrieval-batch", type=int_in(1, 4096), default=4, metavar="N",
                        help="most questions embedded and searched in one batch (default 4: on CPU larger batches save "
                             "little and delay the model; raise it on a GPU)")
    parser.add_argument("--prefill-wait", type=number_in(NumberRange(0, 10, integer=False)), default=0.05,
                        metavar="S", help="seconds a step whose new prompts wait may be held while the retrieval "
                                          "stage finishes a batch, so that its prompts join the same pass (0.05; 0: never)")
    parser.add_argument("--queue-size", type=int_in(1, 1_000_000), default=64, metavar="N",
                        help="requests that may wait (not yet generating) before new ones get 429 (64)")
    parser.add_argument("--max-running", type=int_in(1, 4_096), default=16, metavar="N",
                        help="sequences generating together in one batch (16; 1: one request at a time)")
    parser.add_argument("--step-tokens", type=int_in(1, 1 << 20), default=2048, metavar="N",
                        help="tokens per batched step: one per running sequence plus new prompts' recomputed "
                             "tokens (2048; at least --max-running)")
    parser.add_argument("--request-timeout", type=seconds_in(DAY_S), default=120.0, metavar="S",
                        help="per-request deadline in seconds, queue wait included (120)")
    parser.add_argument("--separator", default="<<PIC_SEP>>", metavar="STR",
                        help="segment separator of /v1/completions prompts (<<PIC_SEP>>)")
    parser.add_argument("--no-segment-matching", dest="match_segments", action="store_false",
                        help="cut completion and chat prompts only at separators: do not look for indexed chunks "
                        "and seen segments in them (matching is on by default)")
    parser.add_argument("--max-segments", type=int_in(1, 65_536), default=256, metavar="N",
                        help="separated segments of one completion prompt, the query included; more get 413 (256)")
    parser.add_argument("--max-document-tokens", type=int_in(1, 1 << 30), default=500_000, metavar="N",
                        help="tokens of one document added through POST /v1/documents; more get 413 (500000)")
    parser.add_argument("--max-body-bytes", type=int_in(1, 1 << 32), default=8 << 20, metavar="N",
                        help="largest request body accepted; larger ones get 413 (8 MiB)")
    parser.add_argument("--shutdown-grace", type=seconds_in(DAY_S), default=30.0, metavar="S",
                        help="seconds in-flight requests get to finish on shutdown (30)")
    keys = parser.add_argument_group("API keys (docs/service.md, 'API keys')")
    # the variables' names are `server.auth.API_KEY_ENV` / `ADMIN_KEY_ENV` (not imported here: `--help` stays light)
    keys.add_argument("--api-key", metavar="KEY",
                      help="key every request must send as 'Authorization: Bearer KEY' (default: $HYPIC_RAG_API_KEY; "
                           "unset: no key). Alone it gives full access")
    keys.add_argument("--admin-key", metavar="KEY",
                      help="key document changes need (POST, DELETE /v1/documents; default: $HYPIC_RAG_ADMIN_KEY); "
                           "then --api-key may only read (403 on a change)")
    keys.add_argument("--metrics-need-key", action="store_true",
                      help="/metrics needs a key too (default: open, like /healthz, for scrapers)")
    keys.add_argument("--allow-no-key", action="store_true",
                      help="serve an address other than loopback without any key (logged as a warning)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="server log level (info)")
    parser.add_argument("--workers", type=worker_count_or_auto, default=AUTO, metavar="N|auto",
                        help="model worker processes on this host behind this endpoint, each request to the least "
                             "loaded (data parallel over the cores, no Ray; each loads the model; over a writable "
                             "index worker-0 writes it and gets every document route, the others follow its writes). "
                             "1: this process serves alone. auto (the default): one worker per core this process may "
                             "use (at most 8) on a CPU with at least 2 cores when the model's weights are at most "
                             "64 MiB, else 1")
    parser.add_argument("--threads", type=int_in(1, 1_024), default=None, metavar="N",
                        help="intra-op threads of each model process (default: the cores this process may use "
                             "divided by the workers, at least 1)")
    scale = parser.add_argument_group("scale-out (Ray; needs the ray extra)")
    scale.add_argument("--replicas", type=int_in(1, 1_024), default=1, metavar="N",
                       help="model replicas behind this endpoint, as Ray Serve deployments; each request goes to the "
                            "replica holding its retrieved chunks hot (1: this process serves alone). Replicas open "
                            "the index read-only")
    scale.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="the Ray cluster for --replicas and --encode-actors: 'auto', host:port or ray://host:port "
                            "(default, and without ADDRESS: a private Ray instance on this machine)")
    scale.add_argument("--encode-actors", type=int_in(0, 1_024), default=0, metavar="K",
                       help="Ray actors per replica that encode a request's cache misses in parallel, longest first "
                            "(0: encoded by the replica itself)")
    scale.add_argument("--replica-cpus", type=number_in(NumberRange(0, 1_024, integer=False, minimum_exclusive=True)), default=1.0, metavar="C",
                       help="CPU slots each replica reserves on the cluster (1; one GPU each when --device is cuda)")
    scale.add_argument("--max-in-flight", type=int_in(1, 4_096), default=4, metavar="N",
                       help="requests a replica serves before its affine requests overflow to the next-ranked (4)")
    parser.set_defaults(func=run_serve)


def _check_docstore(index_dir: Path) -> None:
    """Open the index's docstore once before anything loads: a damaged one is one line (an `IndexCorruptError`,
    exit 1), not a failed application start-up with a traceback."""
    from hypic_rag.retrieval.corpus_index import DOCSTORE_FILE
    from hypic_rag.retrieval.docstore import DocStore

    DocStore(index_dir / DOCSTORE_FILE).close()


def run_serve(args: argparse.Namespace) -> int:
    from hypic_rag.utils.paths import unusable_directory_reason
    from hypic_rag.retrieval.corpus_index import check_not_locked
    from hypic_rag.retrieval.errors import IndexLockedError
    from hypic_rag.retrieval.manifest import MANIFEST_FILE, IndexManifest
    from hypic_rag.runtime.model import ModelLoadError, check_model_directory
    from hypic_rag.server.config import ServerConfig
    from hypic_rag.server.runner import AddressInUseError, bind_socket, serve

    if args.workers == AUTO and args.replicas > 1:
        args.workers = 1  # --replicas N: the model runs on Ray Serve, not in local workers
    _check_scale_out_options(args)
    _keys_from_environment(args)
    _check_exposure(args)
    index_dir = Path(args.index).expanduser()
    if not (index_dir / MANIFEST_FILE).is_file():
        raise CliError(
            f"no index at {str(index_dir)!r}; build one with `hypic-rag precompute CORPUS --index {args.index}`",
            EXIT_BAD_INPUT,
        )
    unwritable = unusable_directory_reason(index_dir)  # SQLite writes its journal there, even for --read-only
    if unwritable is not None:
        raise CliError(f"index directory unusable: {unwritable}", EXIT_BAD_INPUT)
    _check_docstore(index_dir)
    manifest = IndexManifest.load(index_dir.resolve())  # an unreadable one: IndexCorruptError, exit 1
    manifest.check_cache_format(args.cache_format, args.index)  # another format: IndexMismatchError, exit 3
    model_path = Path(args.model).expanduser() if args.model else Path(manifest.model.path)
    layout = _choose_layout(args, model_path)
    if args.replicas > 1 or args.encode_actors or args.workers > 1:  # its processes end with it, however it ends
        from hypic_rag.utils.reaper import reap_on_exit

        reap_on_exit()
    cache_dir = _cache_dir(args)
    try:
        config = ServerConfig(
            index_dir=index_dir,
            model_path=Path(args.model).expanduser() if args.model else None,
            device=args.device,
            dtype=args.dtype,
            read_only=args.read_only,
            hop_slots=args.hop_slots,
            neighbours=args.neighbours,
            queue_size=args.queue_size,
            retrieval_batch=args.retrieval_batch,
            prefill_wait_s=args.prefill_wait,
            max_running=args.max_running,
            step_tokens=args.step_tokens,
            request_timeout_s=args.request_timeout,
            separator=args.separator,
            match_segments=args.match_segments,
            max_segments=args.max_segments,
            max_document_tokens=args.max_document_tokens,
            max_body_bytes=args.max_body_bytes,
            shutdown_grace_s=args.shutdown_grace,
            remote_cache=remote_cache_config(args),
            miss_encoders=_miss_encoders(args),
            recompute_policy=args.recompute_policy,
            cache_dir=cache_dir,
            cache_format=args.cache_format,
            api_key=args.api_key,
            admin_key=args.admin_key,
            metrics_need_key=args.metrics_need_key,
            page=args.page,
        )
    except ValueError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    replicated = args.replicas > 1 or args.workers > 1
    if not args.read_only and args.replicas < 2:  # this process or worker-0 will write the index
        try:
            check_not_locked(index_dir)
        except IndexLockedError as error:
            raise CliError(f"{error}; stop it or pass --read-only", EXIT_FAILURE) from None
        except OSError as error:
            raise CliError(f"cannot open the index for writing ({error}); pass --read-only", EXIT_FAILURE) from None
    try:
        sock = bind_socket(args.host, args.port)
    except AddressInUseError as error:
        hint = "stop the other server or pass another --port" if error.errno == errno.EADDRINUSE else "check --host"
        raise CliError(f"{error.strerror}; {hint}", EXIT_FAILURE) from None
    try:  # cheap checks of the model directory (the lock and the port come first; the model loads later)
        check_model_directory(model_path, require_tokenizer=True)
    except ModelLoadError as error:
        sock.close()
        raise CliError(f"{error}{'' if args.model else '; pass --model'}", EXIT_BAD_INPUT) from None
    package_logger = logging.getLogger("hypic_rag")
    level_before = package_logger.level  # restored when serve returns (in-process callers, tests)
    package_logger.setLevel(getattr(logging, args.log_level.upper()))
    logger.info("serve: %s", layout)
    port = sock.getsockname()[1]

    def announce() -> None:
        replicas = (f" with {args.workers} workers ({'read-only' if args.read_only else 'worker-0 writes the index'})"
                    if args.workers > 1 else f" with {args.replicas} replicas (read-only)" if replicated else "")
        print(f"hypic-rag: serving {index_dir}{replicas} on http://{args.host}:{port} (OpenAPI page: /docs)", flush=True)

    try:
        if args.workers > 1:
            from hypic_rag.distributed.serve_front import serve_with_workers

            started = serve_with_workers(config, args.workers, args.host, port, sock=sock, log_level=args.log_level,
                                         on_ready=announce, max_in_flight=args.max_in_flight, threads=args.threads)
        elif replicated:  # Ray is imported only here
            started = _serve_replicated(args, config, port, sock, announce)
        else:
            import torch

            torch.set_num_threads(args.threads)  # this process runs the model
            started = serve(config, args.host, port, log_level=args.log_level, sock=sock, on_ready=announce)
    except Exception as error:  # noqa: BLE001 - every start-up failure becomes one line
        raise _startup_error(error) from None
    finally:
        sock.close()
        package_logger.setLevel(level_before)
    if not started:
        raise CliError("the server failed to start (reason logged above)", EXIT_FAILURE)
    return EXIT_OK


AUTO = "auto"


def worker_count_or_auto(text: str) -> int | str:
    """The argparse `type` of --workers: "auto" or an integer in 1..256."""
    return AUTO if text.strip().lower() == AUTO else int_in(1, 256)(text)


def _choose_layout(args: argparse.Namespace, model_path: Path) -> str:
    """Resolve `--workers auto` (`auto_workers`: this process's cores, the model's weight bytes, the device) and
    `--threads` (None: the cores shared out, `worker_threads`) into `args`; the line saying what and why."""
    import torch

    from hypic_rag.distributed.local_workers import auto_workers, host_cores, layout_reason, weight_bytes, worker_threads

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cores, size = host_cores(), weight_bytes(model_path)
    chosen = args.workers == AUTO
    if chosen:
        args.workers = auto_workers(cores, size, device=device)
    chosen = chosen and args.threads is None
    if args.threads is None:
        args.threads = worker_threads(args.workers, cores)
    if args.replicas > 1:
        return f"{args.replicas} Ray replicas (--replicas)"
    return layout_reason(args.workers, args.threads, cores, size, device, chosen=chosen)


def _check_scale_out_options(args: argparse.Namespace) -> None:
    """Options that would do nothing are refused (exit 2), not ignored: --ray names the cluster of --replicas N
    (N > 1) and --encode-actors K, and means nothing without one of them."""
    if args.replicas > 1 and args.workers > 1:
        raise CliError("--workers N runs the model in N processes on this host and --replicas N on Ray Serve; "
                       "choose one", EXIT_BAD_INPUT)
    if args.replicas > 1 and args.threads is not None:
        raise CliError("--threads sets the threads of this host's model processes; Ray replicas take "
                       "--replica-cpus", EXIT_BAD_INPUT)
    if args.ray is not None and args.replicas < 2 and not args.encode_actors:
        raise CliError("--ray names the Ray cluster for --replicas N (N > 1) or --encode-actors K, and this server "
                       "would use neither; add one of them, or drop --ray", EXIT_BAD_INPUT)


def _keys_from_environment(args: argparse.Namespace) -> None:
    """--api-key / --admin-key not given: the environment's (`HYPIC_RAG_API_KEY`, `HYPIC_RAG_ADMIN_KEY`; empty: none)."""
    import os

    from hypic_rag.server.auth import ADMIN_KEY_ENV, API_KEY_ENV

    args.api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    args.admin_key = args.admin_key or os.environ.get(ADMIN_KEY_ENV) or None


def _check_exposure(args: argparse.Namespace) -> None:
    """An address other than loopback is served without a key only when asked (--allow-no-key, then a warning):
    anyone who reaches the port could otherwise change the index (exit 2)."""
    from hypic_rag.server.auth import API_KEY_ENV, is_loopback

    if args.api_key or args.admin_key or is_loopback(args.host):
        return
    if not args.allow_no_key:
        raise CliError(f"--host {args.host} exposes the server beyond this machine without a key; pass --api-key KEY "
                       f"(or set {API_KEY_ENV}), or --allow-no-key to serve it open", EXIT_BAD_INPUT)
    logger.warning("serving %s without an API key (--allow-no-key): anyone who reaches the port may ask and change "
                   "the index", args.host)


def _cache_dir(args: argparse.Namespace) -> Path | None:
    """`--cache DIR`, checked: a directory that can be written (each replica's, with `{replica}`: its parent)."""
    from hypic_rag.utils.paths import unusable_directory_reason
    from hypic_rag.server.config import REPLICA_PLACEHOLDER

    if args.cache is None:
        return None
    cache_dir = Path(args.cache).expanduser()
    templated = REPLICA_PLACEHOLDER in args.cache
    if templated and args.replicas < 2 and args.workers < 2:
        raise CliError(f"--cache: {REPLICA_PLACEHOLDER} names a directory per replica and needs --replicas N or "
                       "--workers N (N > 1)", EXIT_BAD_INPUT)
    checked = Path(args.cache.split(REPLICA_PLACEHOLDER)[0]).expanduser() if templated else cache_dir
    reason = unusable_directory_reason(checked)
    if reason is not None:
        raise CliError(f"segment cache directory unusable: {reason}; pass another --cache", EXIT_BAD_INPUT)
    return cache_dir


def _miss_encoders(args: argparse.Namespace):  # noqa: ANN202 - a RayMissEncoders, or None
    """`--encode-actors K`: the factory of each replica's (or this server's) Ray actors; Ray is imported only here."""
    if not args.encode_actors:
        return None
    from hypic_rag.distributed.ray_encoder import RayMissEncoders

    return RayMissEncoders(address=args.ray or "local", actors=args.encode_actors)


def _serve_replicated(args: argparse.Namespace, config, port: int, sock, announce) -> bool:  # noqa: ANN001
    """`--replicas N`: the replicas on Ray Serve (the cluster of --ray), the front here."""
    from hypic_rag.distributed.cluster import ClusterConfig
    from hypic_rag.distributed.serve_front import serve_with_replicas
    from hypic_rag.distributed.serve_replicas import ReplicaConfig

    try:
        cluster = ClusterConfig(address=args.ray or "local")
        options = ReplicaConfig(replicas=args.replicas, replica_cpus=args.replica_cpus,
                                 gpu=str(args.device or "").startswith("cuda"))
    except ValueError as error:
        raise CliError(str(error), EXIT_BAD_INPUT) from None
    return serve_with_replicas(config, options, args.host, port, cluster=cluster, sock=sock,
                               log_level=args.log_level, on_ready=announce, max_in_flight=args.max_in_flight)


def _startup_error(error: Exception) -> HypicError:
    """The error to report for one raised while the backend opened: a `HypicError` as it is (its exit code: 3 for
    an index built for another model, 2 for bad input, 1 otherwise), a held writer lock with what to do about it,
    anything else as a failed start (exit 1)."""
    from hypic_rag.retrieval.errors import IndexLockedError

    logger.debug("start-up failed", exc_info=error)
    if isinstance(error, IndexLockedError):
        return CliError(f"{error}; stop it or pass --read-only", EXIT_FAILURE)
    if isinstance(error, HypicError):
        return error
    return CliError(f"the server failed to start: {type(error).__name__}: {error} (--log-level debug shows the "
                    "traceback)", EXIT_FAILURE)
