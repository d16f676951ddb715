"""The HTTP front of `hypic-rag serve --replicas N`: one endpoint, the same API, requests routed by cache affinity.

Every request is forwarded whole to one replica, which runs the single-process service's own application (so
answers, errors, limits, deadlines, 429 back-pressure and streams are the single server's), and the replica's
response is streamed back as it is produced. What the front adds is the choice of replica:

- `POST /v1/ask`: the front retrieves first (the index's embedder and FAISS, opened read-only here) and routes by
  the retrieved chunk ids (`rendezvous.RendezvousRouter`): a chunk's entry is then hot in one replica, whatever
  order or company it is retrieved in;
- `POST /v1/completions`, `POST /v1/chat/completions`: by the digests of the cached segments (every separated
  part of the prompt but the query, every part of a chat message but the last message's last one);
- the document routes (`owner_route`: adding, deleting and listing documents, job status) when an `owner` is
  named (local workers over a writable index): that worker alone, the index's one writer (503 while it restarts);
- while the owner has document jobs pending, every other request passes it over (`RendezvousRouter.acquire`'s
  `avoid`) for as long as another replica is in rotation with room below its in-flight limit: the owner's model
  worker gives its jobs at most a fifth of its time while questions generate there (`server.worker.JOB_SHARE`),
  so its jobs run faster without them.
  The front marks the owner busy when it relays an owner route's 202 (a job accepted) and, while it is busy, asks
  the owner's `/healthz` every `OWNER_JOBS_POLL_S` for its `pending_jobs` (no poll while none is pending); 0, or
  an owner that cannot answer (dead or restarting: its jobs died with it), releases it;
- anything else (and a body the front cannot read, which the replica will refuse with the proper error): the
  least loaded replica.

`GET /v1/cache/stats` and `GET /healthz` gather every replica's answer, each under its replica id, with the
router's counts; `GET /metrics` is the replicas' metrics merged (`merge_metrics`: the whole server's counts) and
the front's own (requests routed, in flight and overflowed per replica; whether the owner is passed over).
A response carries `X-Hypic-Replica`, the replica that served it. Replicas are `ReplicaClient`s: Ray Serve
deployments (`serve_replicas.py`), worker processes on this host (`local_workers.WorkerClient`: HTTP/1.1 over a
Unix socket, `unix_http.py`), in-process applications in tests. Forwarded routes are a plain ASGI endpoint
(`Front.forward`), cheap per request: it is on the serial path of every request the server answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route
from starlette.types import Receive, Send

from hypic_rag.version import __version__
from hypic_rag.distributed.asgi_bridge import ForwardedRequest, ResponseStart
from hypic_rag.distributed.rendezvous import DEFAULT_MAX_IN_FLIGHT, NoReplicaAvailable, RendezvousRouter, RouteDecision
from hypic_rag.errors import HypicError
from hypic_rag.utils.limits import question_problem
from hypic_rag.server import (
    WRITE_PREFIXES,
    ServerConfig,
    check_api_keys,
    limit_body_size,
    unavailable_response,
    unreadable_body_response,
)

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-hypic-replica"
FORWARDED_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
"""The methods the front forwards (any other: 405)."""
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"})
DEFAULT_TOP_K = 4
"""`/v1/ask`'s default top_k (its schema's)."""
JOBS_PREFIX = "/v1/jobs"
"""Job status routes: the jobs live in the worker that runs them, the index's owner."""
OWNER_JOBS_POLL_S = 0.5
"""Seconds between two asks of the owner's `/healthz` while it has document jobs pending (none otherwise)."""


def owner_route(path: str) -> bool:
    """Whether a request to `path` must reach the index's owner: a document route (any method: the changes, and
    the listing, which then reports the owner's `read_only`) or a job's status."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in (*WRITE_PREFIXES, JOBS_PREFIX))


class ReplicaUnreachable(HypicError):
    """A replica client could not deliver a request (connection refused or reset before any response started):
    the replica did not answer it, so the front may send it to another one."""


class ReplicaStartError(HypicError):
    """A replica or a `--workers` process could not start (its model, index or cache failed to open, it died while
    loading, or the cluster lacks the resources)."""


class ReplicaClient(Protocol):
    """One replica: streams a forwarded request's response (a `ResponseStart`, then body parts); raises
    `ReplicaUnreachable` before the start when the replica cannot be reached."""

    def stream(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]: ...


Retrieve = Callable[[str, int], Awaitable[list[str]]]
"""(question, top_k) -> the chunk ids a replica will retrieve for it (`IndexRetriever.chunk_ids`)."""


class IndexRetriever:
    """The index opened for search in one thread of its own (its SQLite connection belongs to that thread):
    `chunk_ids(question, top_k)` retrieves as a replica will, with the server's hop slots."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hypic-front-retrieval")
        self._index: Any = None
        self._executor.submit(self._open).result()

    def _open(self) -> None:
        from hypic_rag.retrieval.corpus_index import CorpusIndex

        self._index = CorpusIndex.open(self.config.index_dir)
        self._index.embedder.load()

    def _search(self, question: str, top_k: int) -> list[str]:
        hop_slots = self.config.hop_slots if self.config.hop_slots < top_k else 0
        return [hit.chunk.chunk_id for hit in self._index.search(question, k=top_k, hop_slots=hop_slots)]

    async def chunk_ids(self, question: str, top_k: int) -> list[str]:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._search, question, top_k)

    def close(self) -> None:
        def close_index() -> None:
            if self._index is not None:
                self._index.close()

        self._executor.submit(close_index).result()
        self._executor.shutdown()


def segment_keys(parts: Sequence[str]) -> list[str]:
    """Affinity keys of cached text segments: a digest of each (equal text, equal key, on every front)."""
    return [hashlib.sha256(part.encode("utf-8", "surrogatepass")).hexdigest()[:32] for part in parts if part]


def completion_keys(body: Mapping[str, Any], separator: str) -> list[str]:
    """The cached segments of a completion request: each prompt's separated parts but its last (the query)."""
    separator = body.get("separator") if isinstance(body.get("separator"), str) and body["separator"] else separator
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts if isinstance(prompts, list) else []
    parts = [part for prompt in prompts if isinstance(prompt, str) for part in prompt.split(separator)[:-1]]
    return segment_keys(parts)


def chat_keys(body: Mapping[str, Any], separator: str) -> list[str]:
    """The cached documents of a chat request: every part of every message but the last message's last part."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return []
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.extend(content.split(separator))
        elif isinstance(content, list):
            parts.extend(item["text"] for item in content if isinstance(item, dict) and isinstance(item.get("text"), str))
    return segment_keys(parts[:-1])


class Front:
    """Routes and forwards requests to `replicas` (replica id -> client); `retrieve` None routes `/v1/ask` by load
    alone (local workers, which share one segment cache: `local_workers.py`); `owner`: the replica that writes the
    index, which alone gets the document routes (`owner_route`; None: any replica, each refusing changes) and is
    passed over by the other requests while it has document jobs pending (`owner_busy`; `owner_jobs_poll_s`
    between two asks of its `/healthz` meanwhile)."""

    def __init__(
        self, config: ServerConfig, replicas: Mapping[str, ReplicaClient], retrieve: Retrieve | None,
        *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, owner: str | None = None,
        owner_jobs_poll_s: float = OWNER_JOBS_POLL_S,
    ) -> None:
        if owner is not None and owner not in replicas:
            raise ValueError(f"owner {owner!r} is not one of the replicas {sorted(replicas)}")
        if owner_jobs_poll_s <= 0:
            raise ValueError(f"owner_jobs_poll_s must be > 0, got {owner_jobs_poll_s}")
        self.config = config
        self.replicas = dict(replicas)
        self.retrieve = retrieve
        self.owner = owner
        self.router = RendezvousRouter(list(self.replicas), max_in_flight=max_in_flight)
        self.owner_jobs_poll_s = owner_jobs_poll_s
        self.owner_busy = False
        """Whether the owner has document jobs pending, as far as the front knows (it accepted one through the
        front, and its `/healthz` has not yet counted 0 since)."""
        self._owner_jobs_accepted = 0  # jobs the owner accepted through this front: a poll's answer is stale if it grew
        self._owner_watch: asyncio.Task[None] | None = None

    def _owner_job_accepted(self) -> None:
        """The owner answered a document route with 202 (a job queued there): pass it over until its jobs end."""
        self._owner_jobs_accepted += 1
        if not self.owner_busy:
            logger.info("%s has document jobs pending: questions go to the other replicas while they have room",
                        self.owner)
        self.owner_busy = True
        if self._owner_watch is None or self._owner_watch.done():
            self._owner_watch = asyncio.get_running_loop().create_task(self._watch_owner_jobs())

    async def _watch_owner_jobs(self) -> None:
        """Ask the owner's `/healthz` every `owner_jobs_poll_s` until it counts no pending job (and no job was
        accepted while it answered) or cannot answer (dead, restarting or stopping: its jobs end with it); then
        the owner takes questions again."""
        assert self.owner is not None
        try:
            while True:
                await asyncio.sleep(self.owner_jobs_poll_s)
                accepted = self._owner_jobs_accepted
                status, body = await self.ask_replica(self.owner, "/healthz")
                pending = body.get("pending_jobs") if status == 200 and isinstance(body, dict) else None
                if isinstance(pending, int) and pending > 0:
                    continue
                if pending is not None and accepted != self._owner_jobs_accepted:
                    continue  # a job accepted while the owner answered may not be counted in it: ask again
                logger.info("%s has no document job pending%s: it takes questions again", self.owner,
                            "" if pending is not None else f" (its /healthz answered {status})")
                return
        finally:  # also when the front stops: never an owner passed over for good
            self.owner_busy = False

    async def affinity_keys(self, path: str, body: bytes) -> list[str]:
        """What to route a request by (empty: no affinity, the least loaded replica). A body nested too deeply to
        parse raises its `RecursionError` (the front answers 400, as the single server does)."""
        if path not in ("/v1/ask", "/v1/completions", "/v1/chat/completions") or (
                path == "/v1/ask" and self.retrieve is None):  # by load alone: the body is the worker's to read
            return []
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return []  # the replica refuses it with the proper error
        if not isinstance(parsed, dict):
            return []
        if path == "/v1/completions":
            return completion_keys(parsed, self.config.separator)
        if path == "/v1/chat/completions":
            return chat_keys(parsed, self.config.separator)
        if self.retrieve is None:
            return []
        question, top_k = parsed.get("question"), parsed.get("top_k", DEFAULT_TOP_K)
        if not isinstance(question, str) or not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            return []
        if question_problem(question, self.config.max_question_chars) is not None:
            return []  # the replica refuses it (too long, a lone surrogate, empty): never embedded here
        try:
            return await self.retrieve(question, min(top_k, self.config.max_top_k))
        except Exception as error:  # noqa: BLE001 - routing only: the replica answers (or refuses) the request
            logger.warning("front retrieval failed, routing by load: %s", error)
            return []

    async def forward(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """An ASGI application: send the request to the replica the router chooses and stream its response back.
        A replica that cannot be reached is taken out of rotation and the request goes to the next one (it never
        reached the first); 503 when none is in rotation; 400 for a body nested too deeply to parse."""
        body = await _read_body(receive)
        if body is None:
            return  # the client went away while sending its body
        path = scope["path"]
        to_owner = self.owner is not None and owner_route(path)
        try:
            keys = [] if to_owner else await self.affinity_keys(path, body)
        except RecursionError as error:
            await unreadable_body_response(error)(scope, receive, send)
            return
        client = scope.get("client")
        forwarded = ForwardedRequest(
            method=scope["method"], path=path, query_string=scope.get("query_string", b""),
            headers=(*((key, value) for key, value in scope["headers"]
                       if key not in HOP_BY_HOP and key not in (b"host", b"content-length")),
                     (b"content-length", str(len(body)).encode())),
            body=body, client=(client[0], client[1]) if client else ("127.0.0.1", 0),
            raw_path=scope.get("raw_path") or b"",
        )
        for _attempt in range(1 if to_owner else len(self.replicas)):  # a change is never sent to another worker
            try:
                decision = (self.router.acquire_on(self.owner) if to_owner else
                            self.router.acquire(keys, avoid=self.owner if self.owner_busy else None))
            except NoReplicaAvailable as error:
                await unavailable_response(f"{error}; the server is restarting it, retry shortly")(scope, receive, send)
                return
            try:
                parts = self.replicas[decision.replica].stream(forwarded)
                start = await anext(parts)
            except ReplicaUnreachable as error:
                self.router.release(decision)
                self.router.mark_down(decision.replica, f"unreachable ({error})")
                continue
            except BaseException:
                self.router.release(decision)
                raise
            break
        else:
            what = f"the index's owner ({self.owner})" if to_owner else "no replica"
            await unavailable_response(f"{what} could not be reached; the server is restarting it, retry shortly")(
                scope, receive, send)
            return
        if not isinstance(start, ResponseStart):
            self.router.release(decision)
            await _close(parts)
            raise RuntimeError(f"replica {decision.replica} answered without a response start")
        if to_owner and start.status == 202:  # a document job accepted: it runs on the owner's model worker
            self._owner_job_accepted()
        headers = [(k.lower(), v) for k, v in start.headers if k.lower() not in HOP_BY_HOP]
        headers.append((REPLICA_HEADER.encode(), decision.replica.encode()))
        await _relay(parts, start.status, headers, decision, self.router, receive, send)

    async def ask_replica(self, name: str, path: str, *, as_text: bool = False) -> tuple[int, Any]:
        """Replica `name`'s answer to `GET path`: (status, JSON body or None; the body's text with `as_text`);
        (502, an error body) when it cannot answer (taken out of rotation when it cannot be reached)."""
        status, chunks = 502, []
        try:
            async for part in self.replicas[name].stream(ForwardedRequest("GET", path)):
                if isinstance(part, ResponseStart):
                    status = part.status
                else:
                    chunks.append(part)
            body = b"".join(chunks)
            return status, body.decode("utf-8", "replace") if as_text else json.loads(body or b"null")
        except Exception as error:  # noqa: BLE001 - a replica that cannot answer is reported, not fatal
            if isinstance(error, ReplicaUnreachable):
                self.router.mark_down(name, f"unreachable ({error})")  # logged once, not per health check
            else:
                logger.warning("replica %s did not answer %s: %s", name, path, error)
            return 502, {"error": {"message": f"replica unreachable: {type(error).__name__}: {error}"}}

    async def gather(self, path: str, *, as_text: bool = False) -> dict[str, tuple[int, Any]]:
        """Every replica's answer to `GET path` (`ask_replica`): replica id -> (status, body)."""
        answers = await asyncio.gather(*(self.ask_replica(name, path, as_text=as_text) for name in self.replicas))
        return dict(zip(self.replicas, answers))


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body from ASGI `receive` (None if the client disconnected before it ended)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _close(parts: AsyncIterator[ResponseStart | bytes]) -> None:
    closer = getattr(parts, "aclose", None)
    if closer is not None:
        await closer()


async def _relay(parts: AsyncIterator[ResponseStart | bytes], status: int, headers: list[tuple[bytes, bytes]],
                 decision: RouteDecision, router: RendezvousRouter, receive: Receive, send: Send) -> None:
    """Send a replica's response (`status`, `headers`, then `parts`' bytes as they come) to the front's client.

    A watcher task waits for the client's disconnect; if it comes before the response's end, it cancels this
    task, which then closes `parts` (so the replica sees its client go) and returns as if the response had ended.
    A replica that drops the connection mid-body cuts the response short: one warning, and the client's
    connection is closed without the body's end. The router's slot is released at the end either way."""
    task = asyncio.current_task()
    state = {"finished": False, "disconnected": False}

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not state["finished"] and task is not None:
            state["disconnected"] = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch_disconnect())
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        async for part in parts:
            if isinstance(part, bytes):
                await send({"type": "http.response.body", "body": part, "more_body": True})
        state["finished"] = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not state["disconnected"] or task is None:
            raise
        task.uncancel()  # the client went away: not a cancellation of the server's
    except ReplicaUnreachable as error:
        logger.warning("replica %s: %s; the response was cut short", decision.replica, error)
    finally:
        state["finished"] = True
        if not watcher.done():
            watcher.cancel()
        router.release(decision)
        await _close(parts)


SUMMED_HEALTH_FIELDS = ("queue_depth", "queue_capacity", "pending_jobs")
"""`/healthz` fields each replica counts for itself: the front's answer sums them over the replicas."""
PER_PROCESS_FIELDS = ("hot_entries", "hot_bytes", "hot_budget_bytes", "hot_evictions", "hot_hits", "disk_hits")
"""Cache counters each replica keeps for itself (summed over the replicas), besides its remote tier's (``remote_*``:
also its own); the others are its store's, shared by the replicas that open the same directory."""
PER_ENTRY_FIELDS = ("bytes_per_entry", "linear_bytes_per_entry", "kv_bytes_per_entry", "hit_rate")


def merge_cache_stats(caches: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The replicas' `/v1/cache/stats` ``cache`` parts as one: per-process counters (hot tier, hit split, the remote
    tier's counters) summed over the replicas; store counters taken once per distinct store directory (replicas
    on one host share one; `--cache DIR/{replica}` gives each its own), summed when there are several, and then
    listed under ``paths``. ``remote_available`` is true only when every replica reaches the remote."""
    if not caches:
        return {}
    merged: dict[str, Any] = dict(caches[0])
    stores = list({str(cache.get("path")): cache for cache in caches}.values())  # one per directory
    for name, value in caches[0].items():
        counter = isinstance(value, int) and not isinstance(value, bool)
        if name in PER_PROCESS_FIELDS or (name.startswith("remote_") and counter):
            merged[name] = sum(int(cache.get(name, 0)) for cache in caches)
        elif name == "remote_available":
            merged[name] = all(bool(cache.get(name)) for cache in caches)
        elif name == "remote_last_error":
            merged[name] = next((cache[name] for cache in caches if cache.get(name)), "")
        elif len(stores) > 1 and counter and name not in PER_ENTRY_FIELDS:
            merged[name] = sum(int(store.get(name, 0)) for store in stores)
    if len(stores) > 1:
        merged["paths"] = [store.get("path") for store in stores]
        entries = max(int(merged.get("entries", 0)), 1)
        for name, total in (("bytes_per_entry", "value_bytes"), ("linear_bytes_per_entry", "linear_bytes"),
                            ("kv_bytes_per_entry", "kv_bytes")):
            if name in merged:
                merged[name] = int(merged.get(total, 0)) // entries
        lookups = int(merged.get("hits", 0)) + int(merged.get("misses", 0))
        if "hit_rate" in merged:
            merged["hit_rate"] = round(int(merged.get("hits", 0)) / lookups, 4) if lookups else 0.0
    return merged


class _ForwardEndpoint:
    """The catch-all route's ASGI endpoint: `Front.forward` (an object, so the router calls it as ASGI as is)."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self.front.forward(scope, receive, send)


def create_front_app(front: Front) -> FastAPI:
    """The front's application: its own /healthz, /v1/cache/stats and /metrics; everything else forwarded."""
    app = FastAPI(title="hypic-rag (replicas)", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        answers = await front.gather("/healthz")
        replicas = [{"replica": name, "status_code": status, **(body if isinstance(body, dict) else {})}
                    for name, (status, body) in answers.items()]
        ready = all(status == 200 for status, _ in answers.values())
        first = next((body for _, body in answers.values() if isinstance(body, dict) and "model" in body), {})
        summary = {**first, "status": "ok" if ready else "degraded", "replicas": replicas}
        for name in SUMMED_HEALTH_FIELDS:  # the whole server's queue, not its first replica's
            summary[name] = sum(int(replica.get(name, 0)) for replica in replicas)
        return JSONResponse(summary, status_code=200 if ready else 503)

    @app.get("/v1/cache/stats")
    async def cache_stats() -> JSONResponse:
        answers = await front.gather("/v1/cache/stats")
        replicas = [{"replica": name, **body} for name, (status, body) in answers.items()
                    if status == 200 and isinstance(body, dict)]
        cache = merge_cache_stats([replica["cache"] for replica in replicas if isinstance(replica.get("cache"), dict)])
        server = {"cache_hits": 0, "cache_misses": 0}
        for replica in replicas:
            for name in server:
                server[name] += int(replica.get("server", {}).get(name, 0))
        return JSONResponse({
            "cache": cache,
            "index": replicas[0]["index"] if replicas else {},
            "server": server,
            "replicas": replicas,
            "router": front.router.snapshot(),
        }, status_code=200 if len(replicas) == len(answers) else 502)

    @app.get("/metrics")
    async def metrics() -> Response:
        answers = await front.gather("/metrics", as_text=True)
        merged = merge_metrics([text for status, text in answers.values() if status == 200 and isinstance(text, str)])
        owner_busy = front.owner_busy if front.owner is not None else None
        return Response(merged + render_metrics(front.router.snapshot(), owner_busy=owner_busy),
                        media_type="text/plain; version=0.0.4")

    app.router.routes.append(Route("/{path:path}", _ForwardEndpoint(front), methods=list(FORWARDED_METHODS),
                                   include_in_schema=False))  # a plain ASGI endpoint: no request object, no task group

    limit_body_size(app, front.config)
    check_api_keys(app, front.config)  # the front checks the keys; its replicas run without (`for_replica`)
    return app


STORE_WIDE_GAUGES = ("hypic_segment_cache_bytes", "hypic_segment_cache_entries")
"""Gauges every replica reads from the one persistent store it shares with the others: merged as their maximum."""
LEAST_GAUGES = ("hypic_segment_cache_remote_up",)
"""Gauges that hold for the server only if they hold for every replica (1 = up): merged as their minimum."""


def merge_metrics(texts: Sequence[str]) -> str:
    """The replicas' Prometheus texts as one server's: each sample (name and labels) summed over the replicas
    (counters, histogram buckets, queue and batch gauges), the store-wide gauges' maximum, `remote_up`'s minimum,
    a `_created` timestamp's earliest. Families keep their first text's order, help and type."""
    families: dict[str, tuple[str, str]] = {}  # family name -> (type, help)
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            merged = samples.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                value = float(sample.value)
                if key not in merged:
                    merged[key] = value
                elif sample.name.endswith("_created"):
                    merged[key] = min(merged[key], value)
                elif family.name in STORE_WIDE_GAUGES:
                    merged[key] = max(merged[key], value)
                elif family.name in LEAST_GAUGES:
                    merged[key] = min(merged[key], value)
                else:
                    merged[key] = merged[key] + value
    lines = []
    for name, (kind, documentation) in families.items():
        shown = f"{name}_total" if kind == "counter" else name  # as the replicas wrote it (the parser cuts _total)
        lines += [f"# HELP {shown} {_escape_help(documentation)}", f"# TYPE {shown} {kind}"]
        for (sample_name, labels), value in samples[name].items():
            label_text = ",".join(f'{label}="{_escape_label(text)}"' for label, text in labels)
            lines.append(f"{sample_name}{{{label_text}}} {_prometheus_float(value)}" if labels
                         else f"{sample_name} {_prometheus_float(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _prometheus_float(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render_metrics(snapshot: Mapping[str, Any], *, owner_busy: bool | None = None) -> str:
    """The front's Prometheus text: requests routed and in flight per replica, overflows past the affine replica,
    and (`owner_busy` not None: an index owner is named) whether the owner is passed over for its document jobs."""
    lines = ["# HELP hypic_front_routed_total Requests the front routed to each replica.",
             "# TYPE hypic_front_routed_total counter"]
    lines += [f'hypic_front_routed_total{{replica="{name}"}} {count}' for name, count in snapshot["routed"].items()]
    lines += ["# HELP hypic_front_in_flight Requests each replica is serving for the front now.",
              "# TYPE hypic_front_in_flight gauge"]
    lines += [f'hypic_front_in_flight{{replica="{name}"}} {count}' for name, count in snapshot["in_flight"].items()]
    lines += ["# HELP hypic_front_overflowed_total Requests sent past their affine replica because it was busy.",
              "# TYPE hypic_front_overflowed_total counter", f"hypic_front_overflowed_total {snapshot['overflowed']}"]
    if owner_busy is not None:
        lines += ["# HELP hypic_front_owner_busy 1 while the index's owner has document jobs pending (other "
                  "requests pass it over).", "# TYPE hypic_front_owner_busy gauge",
                  f"hypic_front_owner_busy {int(owner_busy)}"]
    return "\n".join(lines) + "\n"
