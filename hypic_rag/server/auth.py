"""API keys of the REST service: who may read (ask, complete, chat, stats) and who may change the index.

    hypic-rag serve --index index/ --api-key "$KEY"                     # one key: full access
    hypic-rag serve --index index/ --api-key "$KEY" --admin-key "$ADMIN"  # KEY reads; ADMIN reads and writes

Clients send ``Authorization: Bearer <key>`` (what OpenAI's clients send for their ``api_key``). Without any key
the service is open (and `serve` then refuses to bind an address other than loopback unless told
``--allow-no-key``). With keys set:

- `OPEN_PATHS` / `OPEN_PREFIXES` need no key: the health check, the web page and its static files (they carry
  no data; the page's own API calls send the key), and the API's description (`/docs`, `/openapi.json`: the
  schema of the routes, nothing of the corpus). `/metrics` is open too unless `metrics_need_key`, so that a
  Prometheus scraper needs no secret (it reports counts and timings, no text).
- write routes (`is_write`: POST / DELETE of `/v1/documents...`) need the admin key when one is set, else the
  API key (one key, full access, as vLLM's ``--api-key``); a valid read key there gets 403.
- every other route needs the API key or the admin key; a missing or wrong key gets 401.

Keys are compared in constant time (`hmac.compare_digest`), never logged and never echoed in an error body. The
front of ``--workers N`` / ``--replicas N`` checks them; its workers (Unix sockets in a private 0700 directory)
and Ray replicas (reached through Ray handles only, no HTTP proxy) are not reachable from the network and run
without keys (`ServerConfig.for_replica`). The middleware that applies them is `middleware.ApiKeyCheck`; this module
imports nothing of FastAPI (`ServerConfig` holds `ApiKeys`).
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

API_KEY_ENV = "HYPIC_RAG_API_KEY"
ADMIN_KEY_ENV = "HYPIC_RAG_ADMIN_KEY"

OPEN_PATHS = frozenset({"/healthz", "/", "/docs", "/openapi.json", "/favicon.ico"})
"""Paths served without a key (exact match)."""
OPEN_PREFIXES = ("/ui/",)
"""Path prefixes served without a key: the web page's static files."""
METRICS_PATH = "/metrics"
WRITE_PREFIXES = ("/v1/documents",)
"""Routes whose non-GET methods change the index (POST adds documents, DELETE removes one)."""
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_open(path: str, *, metrics_need_key: bool = False) -> bool:
    """Whether `path` is served without a key."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return True
    return path == METRICS_PATH and not metrics_need_key


def is_write(method: str, path: str) -> bool:
    """Whether a `method` request to `path` changes the index (needs the admin key when one is set)."""
    return method.upper() not in READ_METHODS and path.startswith(WRITE_PREFIXES)


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (None when it can): empty, or not printable ASCII without spaces (an HTTP
    header carries it). The message never contains the key."""
    if not key:
        return "is empty"
    if not all(33 <= ord(character) <= 126 for character in key):
        return "must be printable ASCII without spaces"
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1, "localhost"): reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys a service checks (None: not set). `api_key` reads, and writes too unless `admin_key` is set;
    `admin_key` reads and writes. Their repr never shows them."""

    api_key: str | None = None
    admin_key: str | None = None
    metrics_need_key: bool = False

    def __repr__(self) -> str:
        return (f"ApiKeys(api_key={'set' if self.api_key else None}, admin_key={'set' if self.admin_key else None}, "
                f"metrics_need_key={self.metrics_need_key})")

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_key)

    def refusal(self, method: str, path: str, authorization: str | None) -> tuple[int, str, str] | None:
        """(status, code, message) refusing the request, or None when it may go on."""
        if not self.enabled or is_open(path, metrics_need_key=self.metrics_need_key):
            return None
        given = bearer_token(authorization)
        if given is None:
            return 401, "missing_api_key", ("no API key: send the header 'Authorization: Bearer <key>' (this server "
                                            "was started with --api-key)")
        admin = _matches(given, self.admin_key)
        reader = admin or _matches(given, self.api_key)
        if not reader:
            return 401, "invalid_api_key", "invalid API key"
        if is_write(method, path) and self.admin_key and not admin:
            return 403, "permission_denied", (f"{method.upper()} {path.split('?')[0][:100]} changes the index and "
                                              "needs the admin key (--admin-key); this key may only read")
        return None


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (None when absent or of another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(given: str, key: str | None) -> bool:
    """Constant-time comparison (`hmac.compare_digest`, over bytes so that any header text compares)."""
    if not key:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8"))
