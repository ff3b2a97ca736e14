"""The sections of the router's configuration: one frozen dataclass each.

Each field declares its type, default and range once (core/params.py); ``__post_init__``
checks the ranges and what a range cannot say (URLs, header names, endpoints) and raises
``ValueError`` naming the field (docs/architecture.md, convention 7). The loader
(router/config.py) builds them from YAML and names the full key of a bad entry.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlsplit

from kvroute.core.params import ConfigError, check_ranges, param


def check(ok: bool, key: str, reason: str) -> None:
    if not ok:
        raise ConfigError(key, reason)


def normalize_url(url: str) -> str:
    """A backend URL in one spelling per engine; ValueError unless http(s)://host[:port][/path].

    The scheme and host are lower case, an IP literal in its short form (an IPv4-mapped
    IPv6 address as the IPv4 one), the port a plain number (``:019101`` is ``:19101``; the
    scheme's default, 80 or 443, left out as RFC 3986 6.2.3 says), the path without
    ``.``/``..`` segments or trailing slashes. So ``HTTP://127.0.0.1:019101/.`` is
    ``http://127.0.0.1:19101``, and the duplicate checks (config ``backends``, admin add)
    see one engine as one backend; a URL already in that form comes out unchanged.
    Credentials, a query string or a fragment are refused: the URL shows up in response
    headers, the status page, metric labels and error messages, so a secret must travel as
    ``api_key`` (the message never repeats them).
    """
    parts = urlsplit(url.strip())
    shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
    if "@" in parts.netloc:  # userinfo; the message must not repeat the secret
        safe = f"{parts.scheme}://***@{parts.netloc.rpartition('@')[2]}"
        raise ConfigError(
            "backend.url",
            f"credentials in a URL are not allowed ({safe}): "
            "give the key as the backend's api_key instead",
        )
    check("?" not in url, "backend.url", f"a query string is not allowed ({shown}?...)")
    check("#" not in url, "backend.url", f"a fragment is not allowed ({shown}#...)")
    check(parts.scheme in ("http", "https"), "backend.url", f"not an http(s) URL: {url!r}")
    check(bool(parts.hostname), "backend.url", f"no host in {url!r}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    check(port != 0, "backend.url", f"port must be a number in 1-65535 in {shown!r}")
    if port == _DEFAULT_PORTS[parts.scheme]:
        port = None
    netloc = _canonical_host(parts.hostname or "") + (f":{port}" if port is not None else "")
    return f"{parts.scheme}://{netloc}{_canonical_path(parts.path)}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _canonical_host(host: str) -> str:
    """``host`` (lower case, as urlsplit gives it) with an IP literal in its short form."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _canonical_path(path: str) -> str:
    """``path`` without ``.`` and ``..`` segments (RFC 3986 5.2.4) or trailing slashes."""
    out: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            del out[-1:]
        elif segment != ".":
            out.append(segment)
    while out and not out[-1]:
        out.pop()
    return "".join("/" + segment for segment in out)


def backend_public_id(url: str) -> str:
    """The stable opaque id clients see for a backend with no ``name`` when URLs are hidden:
    "b-" and 8 hex digits of the URL's SHA-256. Not a secret: someone who can guess the
    address can confirm it; a configured ``name`` reveals nothing."""
    return "b-" + hashlib.sha256(url.encode()).hexdigest()[:8]


def _cors_origin(origin: object) -> str:
    """An origin as browsers send it (``scheme://host[:port]``, lower case), or ``*``."""
    key = "server.cors_origins"
    check(isinstance(origin, str) and bool(origin.strip()), key, f"not an origin: {origin!r}")
    text = str(origin).strip().lower().rstrip("/")
    if text == "*":
        return text
    parts = urlsplit(text)
    ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path
    check(ok and not (parts.query or parts.fragment or "@" in parts.netloc), key,
          f"{origin!r} is not an origin: scheme://host[:port], or *")  # fmt: skip
    return text


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_zmq_endpoint(endpoint: str, name: str) -> str:
    """A ZMQ endpoint the subscriber can connect to: tcp://host:port (a port in 1-65535;
    ZMQ's ``source;host:port`` form too) or ipc://path. ZMQ would take a bad port only
    to fail later: without one, every connect (a restart loop); out of range, never a
    word while nothing arrives."""
    ok = isinstance(endpoint, str) and endpoint.strip().startswith(("tcp://", "ipc://"))
    check(ok and len(endpoint.strip()) > 6, name, f"not a tcp:// or ipc:// endpoint: {endpoint!r}")
    endpoint = endpoint.strip()
    if endpoint.startswith("tcp://"):
        host, colon, port = endpoint[6:].rpartition(";")[2].rpartition(":")
        check(bool(colon and host.strip("[]")), name,
              f"a tcp:// endpoint is tcp://host:port, got {endpoint!r}")  # fmt: skip
        ok = port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
        check(ok, name, f"port must be 1-65535, got {port!r} in {endpoint!r}")
    return endpoint


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """One upstream engine."""

    SECTION: ClassVar[str] = "backend"

    url: str  # http(s)://host:port, no trailing slash
    api_key: str | None = None  # sent upstream as "Authorization: Bearer ..."
    # relative capacity, passed to Fleet.add_backend; at most 100x another replica (a
    # consistent-hash ring holds virtual_nodes x weight points of it)
    weight: float = param(1.0, gt=0, le=100)
    kv_events: str | None = None  # its KV-event PUB endpoint (vLLM --kv-events-config)
    kv_replay: str | None = None  # its replay ROUTER endpoint (fills gaps, syncs late start)
    # what clients see instead of the URL when expose_backend_urls is off (1-64 of
    # [A-Za-z0-9._-]); None: backend_public_id(url)
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        if self.name is not None:
            ok = isinstance(self.name, str) and 0 < len(self.name) <= 64
            check(ok and set(self.name) <= _NAME_CHARS, "backend.name",
                  f"must be 1-64 of [A-Za-z0-9._-], got {self.name!r}")  # fmt: skip
        check_ranges(self, self.SECTION)
        if self.kv_events is not None:
            ep = check_zmq_endpoint(self.kv_events, "backend.kv_events")
            object.__setattr__(self, "kv_events", ep)
        if self.kv_replay is not None:
            check(self.kv_events is not None, "backend.kv_replay", "needs kv_events too")
            ep = check_zmq_endpoint(self.kv_replay, "backend.kv_replay")
            object.__setattr__(self, "kv_replay", ep)

    @property
    def public_id(self) -> str:
        """How clients see this backend when ``expose_backend_urls`` is off."""
        return self.name or backend_public_id(self.url)


_DAY_S = 86_400


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Upstream timeouts, seconds. Only a connect timeout is retried elsewhere: a slow
    answer may be this request's doing, and it is not run twice."""

    SECTION: ClassVar[str] = "timeouts"

    connect_s: float = param(5.0, gt=0, le=_DAY_S)  # TCP connect to a backend
    first_byte_s: float = param(300.0, gt=0, le=_DAY_S)  # streaming: sent -> response headers
    idle_s: float = param(60.0, gt=0, le=_DAY_S)  # longest gap between two chunks of a body
    total_s: float = param(1800.0, gt=0, le=_DAY_S)  # whole request, first attempt to last byte
    # non-streaming: request sent -> whole answer read (a long generation with no stream
    # runs minutes; a hung one must still end)
    response_s: float = param(600.0, gt=0, le=_DAY_S)
    # a stream silent for idle_s is still waited for while its backend is healthy and its
    # scraped gauges say the engine has requests running or waiting (it may have
    # preempted this one), up to this long without a token; at least idle_s
    stall_s: float = param(600.0, gt=0, le=_DAY_S)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class LimitConfig:
    """Sizes and counts that bound the router's resources."""

    SECTION: ClassVar[str] = "limits"

    # larger request bodies get 413. A 1M-token text prompt is about 4 MB (~4 bytes a
    # token), but images travel inline as base64 data URLs (OpenAI takes 20 MB an image,
    # vLLM sets no limit): 32 MiB holds one such image or a few photos; more only costs
    # parse and keying time (and memory) per request
    max_body_bytes: int = param(32 * 1024 * 1024, ge=1024)
    max_connections: int = param(1024, ge=1)  # pooled upstream connections in total
    max_connections_per_backend: int = param(256, ge=1)  # pooled upstream connections each
    max_attempts: int = param(3, ge=1, le=16)  # backends tried per request before 502/503
    retry_backoff_s: float = param(0.02, ge=0, le=10)  # sleep before attempt k: k * this
    # a non-streaming answer read whole (for its usage.cached_tokens) is cut here: 502
    max_response_bytes: int = param(64 * 1024 * 1024, ge=1024)
    # longer "model" names get 400: the name is a key of routing state until it is refused
    max_model_name_chars: int = param(256, ge=1)

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active health checks, model discovery and the metrics scraper."""

    SECTION: ClassVar[str] = "health"

    interval_s: float = param(5.0, gt=0, le=3600)  # GET /health and /v1/models this often
    # per probe: SGLang's /health runs a one-token generation and polls it each second,
    # so it takes >= 1 s and more under load (sglang-router and vllm-router wait 5 s too)
    timeout_s: float = param(5.0, gt=0, le=60)
    unhealthy_after: int = param(2, ge=1)  # consecutive failed probes -> unhealthy
    healthy_after: int = param(1, ge=1)  # consecutive good probes -> healthy again
    scrape_interval_s: float = param(2.0, ge=0, le=3600)  # GET /metrics this often; 0: off

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-backend circuit breaker on passive failures (connect errors, 5xx, timeouts)."""

    SECTION: ClassVar[str] = "breaker"

    failure_threshold: int = param(5, ge=1)  # consecutive failures that open the circuit
    open_s: float = param(10.0, gt=0, le=3600)  # open this long, then half-open trials
    half_open_successes: int = param(2, ge=1)  # trial successes that close it again

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client API key and its limits (None = unlimited)."""

    SECTION: ClassVar[str] = "clients.keys"

    name: str  # shown in metrics and logs instead of the key
    key: str  # the bearer token clients send
    max_concurrency: int | None = param(None, ge=1)  # requests in flight at once
    rate_per_s: float | None = param(None, gt=0)  # sustained requests per second (bucket)
    burst: int | None = param(None, ge=1)  # bucket size; default max(1, rate_per_s)

    def __post_init__(self) -> None:
        check(bool(self.name), "clients.keys.name", "must not be empty")
        check(len(self.key) >= 8, f"clients.keys[{self.name}].key", "must be >= 8 characters")
        check_ranges(self, self.SECTION)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The client-facing listeners: timeouts that cut slow and idle clients, a connection
    cap, and where the operator endpoints (``/``, ``/metrics``, ``/admin/...``) listen.

    All limits hold per process: with ``--workers N`` each worker applies them alone.
    """

    SECTION: ClassVar[str] = "server"

    keepalive_s: float = param(75.0, gt=0, le=3600)  # idle keep-alive connections closed
    # a new request's line and headers must arrive within this (from the connection's
    # start, or from the request's first byte on a kept-alive connection): slowloris
    header_timeout_s: float = param(10.0, gt=0, le=3600)
    # a request body must arrive whole within this after its headers (a slow body is
    # answered 408 and the connection closed)
    body_timeout_s: float = param(60.0, gt=0, le=3600)
    # open client connections on the API listener; a new one over it is answered 503
    # and closed at once (the admin listener has its own cap, ADMIN_MAX_CONNECTIONS)
    max_client_connections: int = param(4096, ge=1, le=1_000_000)
    # a separate listener for "/", "/metrics" and "/admin/..." (then the API port
    # answers 404 for them, and the admin port 404 for the API); None: one listener
    admin_port: int | None = param(None, ge=0, le=65535)
    admin_host: str | None = None  # the admin listener's address; None: same as host
    metrics_auth: bool = False  # "/" and "/metrics" also need the admin key (bearer)
    # browser origins that may call the API (CORS; router/cors.py): "https://app.example"
    # or "*" for any (vLLM's default); empty: no CORS headers, preflights 405
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_ranges(self, self.SECTION)
        check(self.admin_host is None or bool(self.admin_host), "server.admin_host", "empty")
        origins = tuple(_cors_origin(o) for o in self.cors_origins)
        object.__setattr__(self, "cors_origins", origins)

    @property
    def has_admin_listener(self) -> bool:
        return self.admin_port is not None


# what agent harnesses and chat front-ends send (Claude Code, OpenAI-style gateways)
DEFAULT_SESSION_HEADERS = (
    "x-session-affinity",
    "x-session-id",
    "session_id",
    "x-claude-code-session-id",
)
# RFC 9110 token characters: what a header name may be made of
_HEADER_NAME_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Session hints: where a request says which client session it belongs to, and how
    long the router remembers the backend each session last went to (core/sessions.py).

    The first of ``headers`` present with a usable value wins (at most 256 characters,
    no control characters; an unusable one is skipped, never refused), else the body's
    ``user`` string when ``use_user_field``. No headers and no user field: off.
    """

    SECTION: ClassVar[str] = "sessions"

    headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS  # request headers, first present wins
    use_user_field: bool = True  # the body's "user" (a soft hint: one user, many chats)
    # a session's home is forgotten this long after its last request
    ttl_s: float = param(600.0, gt=0, le=604_800)
    # sessions remembered (least recently seen dropped first)
    max_entries: int = param(100_000, ge=1, le=10_000_000)

    def __post_init__(self) -> None:
        ok = isinstance(self.headers, list | tuple)
        check(ok, "sessions.headers", f"must be a list of header names, got {self.headers!r}")
        names = []
        for h in self.headers:
            name = h.strip().lower() if isinstance(h, str) else ""
            ok = bool(name) and len(name) <= 256 and set(name) <= _HEADER_NAME_CHARS
            check(ok, "sessions.headers", f"not a header name: {h!r}")
            names.append(name)
        object.__setattr__(self, "headers", tuple(dict.fromkeys(names)))
        check_ranges(self, self.SECTION)

    @property
    def enabled(self) -> bool:
        return bool(self.headers) or self.use_user_field


_HOST_PATTERN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-_*?")


def check_backend_pattern(pattern: str) -> str:
    """One ``admin_allowed_backends`` entry: a CIDR (``10.0.0.0/8``, an IP alone is a /32)
    or a host-name glob (``*.engines.internal``); ValueError otherwise."""
    check(isinstance(pattern, str) and bool(pattern.strip()), "admin_allowed_backends",
          f"entries must be CIDRs or host patterns, got {pattern!r}")  # fmt: skip
    pattern = pattern.strip().lower()
    try:
        ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        ok = set(pattern) <= _HOST_PATTERN_CHARS
        check(ok, "admin_allowed_backends", f"not a CIDR or host pattern: {pattern!r}")
    return pattern
