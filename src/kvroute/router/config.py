"""Router configuration: frozen dataclasses, one loader for YAML + command-line flags.

Each dataclass range-checks its fields in ``__post_init__`` and raises ``ValueError``
naming the field (docs/architecture.md, convention 7). ``load_config`` is the only
place that reads YAML.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _check(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {msg}")


def normalize_url(url: str) -> str:
    """A backend URL without trailing slash; ValueError unless http(s)://host[:port].

    Credentials in the URL are refused: the URL shows up in response headers, the status
    page, metric labels and error messages, so a secret must travel as ``api_key``.
    """
    parts = urlsplit(url.strip())
    if "@" in parts.netloc:  # userinfo; the message must not repeat the secret
        safe = f"{parts.scheme}://***@{parts.netloc.rpartition('@')[2]}"
        raise ValueError(
            f"backend.url: credentials in a URL are not allowed ({safe}): "
            "give the key as the backend's api_key instead"
        )
    _check(parts.scheme in ("http", "https"), "backend.url", f"not an http(s) URL: {url!r}")
    _check(bool(parts.hostname), "backend.url", f"no host in {url!r}")
    return url.strip().rstrip("/")


def backend_public_id(url: str) -> str:
    """The stable opaque id clients see for a backend with no ``name`` when URLs are hidden:
    "b-" and 8 hex digits of the URL's SHA-256. Not a secret: someone who can guess the
    address can confirm it; a configured ``name`` reveals nothing."""
    return "b-" + hashlib.sha256(url.encode()).hexdigest()[:8]


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_zmq_endpoint(endpoint: str, name: str) -> str:
    """A ZMQ endpoint the subscriber can connect to (tcp://host:port or ipc://path)."""
    ok = isinstance(endpoint, str) and endpoint.startswith(("tcp://", "ipc://"))
    _check(ok and len(endpoint) > 6, name, f"not a tcp:// or ipc:// endpoint: {endpoint!r}")
    return endpoint.strip()


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """One upstream engine."""

    url: str  # http(s)://host:port, no trailing slash
    api_key: str | None = None  # sent upstream as "Authorization: Bearer ..."
    weight: float = 1.0  # relative capacity, passed to Fleet.add_backend
    kv_events: str | None = None  # its KV-event PUB endpoint (vLLM --kv-events-config)
    kv_replay: str | None = None  # its replay ROUTER endpoint (fills gaps, syncs late start)
    # what clients see instead of the URL when expose_backend_urls is off (1-64 of
    # [A-Za-z0-9._-]); None: backend_public_id(url)
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        if self.name is not None:
            ok = isinstance(self.name, str) and 0 < len(self.name) <= 64
            _check(ok and set(self.name) <= _NAME_CHARS, "backend.name",
                   f"must be 1-64 of [A-Za-z0-9._-], got {self.name!r}")  # fmt: skip
        _check(self.weight > 0, "backend.weight", f"must be > 0, got {self.weight}")
        if self.kv_events is not None:
            ep = check_zmq_endpoint(self.kv_events, "backend.kv_events")
            object.__setattr__(self, "kv_events", ep)
        if self.kv_replay is not None:
            _check(self.kv_events is not None, "backend.kv_replay", "needs kv_events too")
            ep = check_zmq_endpoint(self.kv_replay, "backend.kv_replay")
            object.__setattr__(self, "kv_replay", ep)

    @property
    def public_id(self) -> str:
        """How clients see this backend when ``expose_backend_urls`` is off."""
        return self.name or backend_public_id(self.url)


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Upstream timeouts, seconds. Only a connect timeout is retried elsewhere: a slow
    answer may be this request's doing, and it is not run twice."""

    connect_s: float = 5.0  # TCP connect to a backend
    first_byte_s: float = 300.0  # streaming: request sent -> response headers
    idle_s: float = 60.0  # longest gap between two chunks of a response body
    total_s: float = 1800.0  # whole request, first attempt to last byte
    # non-streaming: request sent -> whole answer read (a long generation with no stream
    # runs minutes; a hung one must still end)
    response_s: float = 600.0
    # a stream silent for idle_s is still waited for while its backend is healthy and its
    # scraped gauges say the engine has requests running or waiting (it may have
    # preempted this one), up to this long without a token; at least idle_s
    stall_s: float = 600.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            _check(0 < value <= 86_400, f"timeouts.{f.name}", f"must be in (0, 86400], got {value}")


@dataclass(frozen=True, slots=True)
class LimitConfig:
    """Sizes and counts that bound the router's resources."""

    # larger request bodies get 413. A 1M-token context is about 4 MB of text (~4 bytes a
    # token), the largest prompt a served model takes today; more only costs parse and
    # keying time (and memory) per request
    max_body_bytes: int = 4 * 1024 * 1024
    max_connections: int = 1024  # pooled upstream connections in total
    max_connections_per_backend: int = 256  # pooled upstream connections per backend
    max_attempts: int = 3  # backends tried per request before 502/503
    retry_backoff_s: float = 0.02  # sleep before attempt k is k * this
    # a non-streaming answer read whole (for its usage.cached_tokens) is cut here: 502
    max_response_bytes: int = 64 * 1024 * 1024
    # longer "model" names get 400: the name is a key of routing state until it is refused
    max_model_name_chars: int = 256

    def __post_init__(self) -> None:
        _check(self.max_body_bytes >= 1024, "limits.max_body_bytes", "must be >= 1024")
        _check(self.max_model_name_chars >= 1, "limits.max_model_name_chars", "must be >= 1")
        _check(self.max_connections >= 1, "limits.max_connections", "must be >= 1")
        _check(
            self.max_connections_per_backend >= 1,
            "limits.max_connections_per_backend",
            "must be >= 1",
        )
        _check(1 <= self.max_attempts <= 16, "limits.max_attempts", "must be in [1, 16]")
        _check(0 <= self.retry_backoff_s <= 10, "limits.retry_backoff_s", "must be in [0, 10]")
        _check(self.max_response_bytes >= 1024, "limits.max_response_bytes", "must be >= 1024")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Active health checks, model discovery and the metrics scraper."""

    interval_s: float = 5.0  # GET /health and /v1/models on every backend this often
    timeout_s: float = 2.0  # per probe
    unhealthy_after: int = 2  # consecutive failed probes -> unhealthy
    healthy_after: int = 1  # consecutive good probes -> healthy again
    scrape_interval_s: float = 2.0  # GET /metrics this often; 0 disables the scraper

    def __post_init__(self) -> None:
        _check(0 < self.interval_s <= 3600, "health.interval_s", "must be in (0, 3600]")
        _check(0 < self.timeout_s <= 60, "health.timeout_s", "must be in (0, 60]")
        _check(self.unhealthy_after >= 1, "health.unhealthy_after", "must be >= 1")
        _check(self.healthy_after >= 1, "health.healthy_after", "must be >= 1")
        _check(
            0 <= self.scrape_interval_s <= 3600, "health.scrape_interval_s", "must be in [0, 3600]"
        )


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Per-backend circuit breaker on passive failures (connect errors, 5xx, timeouts)."""

    failure_threshold: int = 5  # consecutive failures that open the circuit
    open_s: float = 10.0  # time open before half-open lets trial requests through
    half_open_successes: int = 2  # trial successes that close it again

    def __post_init__(self) -> None:
        _check(self.failure_threshold >= 1, "breaker.failure_threshold", "must be >= 1")
        _check(0 < self.open_s <= 3600, "breaker.open_s", "must be in (0, 3600]")
        _check(self.half_open_successes >= 1, "breaker.half_open_successes", "must be >= 1")


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client API key and its limits (None = unlimited)."""

    name: str  # shown in metrics and logs instead of the key
    key: str  # the bearer token clients send
    max_concurrency: int | None = None  # requests in flight at once
    rate_per_s: float | None = None  # sustained requests per second (token bucket)
    burst: int | None = None  # bucket size; default max(1, rate_per_s)

    def __post_init__(self) -> None:
        _check(bool(self.name), "clients.keys.name", "must not be empty")
        _check(len(self.key) >= 8, f"clients.keys[{self.name}].key", "must be >= 8 characters")
        if self.max_concurrency is not None:
            _check(self.max_concurrency >= 1, "clients.keys.max_concurrency", "must be >= 1")
        if self.rate_per_s is not None:
            _check(self.rate_per_s > 0, "clients.keys.rate_per_s", "must be > 0")
        if self.burst is not None:
            _check(self.burst >= 1, "clients.keys.burst", "must be >= 1")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The client-facing listeners: timeouts that cut slow and idle clients, a connection
    cap, and where the operator endpoints (``/``, ``/metrics``, ``/admin/...``) listen.

    All limits hold per process: with ``--workers N`` each worker applies them alone.
    """

    keepalive_s: float = 75.0  # an idle keep-alive connection is closed after this
    # a new request's line and headers must arrive within this (from the connection's
    # start, or from the request's first byte on a kept-alive connection): slowloris
    header_timeout_s: float = 10.0
    # a request body must arrive whole within this after its headers (a slow body is
    # answered 408 and the connection closed)
    body_timeout_s: float = 60.0
    # open client connections on the API listener; a new one over it is answered 503
    # and closed at once (the admin listener has its own cap, ADMIN_MAX_CONNECTIONS)
    max_client_connections: int = 4096
    # a separate listener for "/", "/metrics" and "/admin/..." (then the API port
    # answers 404 for them, and the admin port 404 for the API); None: one listener
    admin_port: int | None = None
    admin_host: str | None = None  # the admin listener's address; None: same as host
    metrics_auth: bool = False  # "/" and "/metrics" also need the admin key (bearer)

    def __post_init__(self) -> None:
        _check(0 < self.keepalive_s <= 3600, "server.keepalive_s", "must be in (0, 3600]")
        _check(0 < self.header_timeout_s <= 3600, "server.header_timeout_s", "must be in (0, 3600]")
        _check(0 < self.body_timeout_s <= 3600, "server.body_timeout_s", "must be in (0, 3600]")
        _check(
            1 <= self.max_client_connections <= 1_000_000,
            "server.max_client_connections",
            "must be in [1, 1000000]",
        )
        if self.admin_port is not None:
            _check(0 <= self.admin_port <= 65535, "server.admin_port", "must be in [0, 65535]")
        _check(self.admin_host is None or bool(self.admin_host), "server.admin_host", "empty")
        _check(isinstance(self.metrics_auth, bool), "server.metrics_auth", "must be a bool")

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

    headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS  # request headers, first present wins
    use_user_field: bool = True  # the body's "user" (a soft hint: one user, many chats)
    ttl_s: float = 600.0  # a session's home is forgotten this long after its last request
    max_entries: int = 100_000  # sessions remembered (least recently seen dropped first)

    def __post_init__(self) -> None:
        ok = isinstance(self.headers, list | tuple)
        _check(ok, "sessions.headers", f"must be a list of header names, got {self.headers!r}")
        names = []
        for h in self.headers:
            name = h.strip().lower() if isinstance(h, str) else ""
            ok = bool(name) and len(name) <= 256 and set(name) <= _HEADER_NAME_CHARS
            _check(ok, "sessions.headers", f"not a header name: {h!r}")
            names.append(name)
        object.__setattr__(self, "headers", tuple(dict.fromkeys(names)))
        _check(isinstance(self.use_user_field, bool), "sessions.use_user_field", "must be a bool")
        _check(0 < self.ttl_s <= 604_800, "sessions.ttl_s", "must be in (0, 604800]")
        ok = isinstance(self.max_entries, int) and 1 <= self.max_entries <= 10_000_000
        _check(ok, "sessions.max_entries", "must be in [1, 10000000]")

    @property
    def enabled(self) -> bool:
        return bool(self.headers) or self.use_user_field


def check_backend_pattern(pattern: str) -> str:
    """One ``admin_allowed_backends`` entry: a CIDR (``10.0.0.0/8``, an IP alone is a /32)
    or a host-name glob (``*.engines.internal``); ValueError otherwise."""
    _check(isinstance(pattern, str) and bool(pattern.strip()), "admin_allowed_backends",
           f"entries must be CIDRs or host patterns, got {pattern!r}")  # fmt: skip
    pattern = pattern.strip().lower()
    try:
        ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        ok = set(pattern) <= _HOST_PATTERN_CHARS
        _check(ok, "admin_allowed_backends", f"not a CIDR or host pattern: {pattern!r}")
    return pattern


_HOST_PATTERN_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789.-_*?")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvroute serve`` needs; built by ``load_config``."""

    backends: tuple[BackendConfig, ...] = ()  # the static fleet; admin API adds more
    policy: str = "prefix"  # core policy name (core/policy registry)
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (0 = any free port)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    limits: LimitConfig = field(default_factory=LimitConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    client_keys: tuple[ClientKey, ...] = ()  # non-empty -> every API call needs a key
    trusted_proxies: tuple[IpNetwork, ...] = ()  # X-Forwarded-For believed only from these
    admin_key: str | None = None  # bearer token of /admin/...; None disables the admin API
    drain_timeout_s: float = 30.0  # on shutdown, wait this long for in-flight requests
    log_prompts: bool = False  # prompts never logged unless set
    # False (--hide-backend-urls): clients never see backend URLs; x-kvroute-backend and
    # error messages carry each backend's public_id (its name, or "b-" + 8 hex digits)
    expose_backend_urls: bool = True
    # routing keys: "approximate" (text keys, cache models fed by dispatches), "exact"
    # (engine token keys, views from KV events), "auto" (token keys for a model while one
    # of its backends' event streams is synced). None: "auto" when a backend has
    # kv_events, else "approximate" (see ``resolved_mode``)
    mode: str | None = None
    speculative_ttl_s: float = 3.0  # exact mode: credit for a dispatch until events confirm
    # served model name -> directory with tokenizer.json (+ tokenizer_config.json) for
    # exact keys on real engines; other models use the built-in tokenizer (the simulator's)
    tokenizers: Mapping[str, str] = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)  # YAML section "server:"
    # backends the admin API may add (admin_allowed_backends: ["10.0.0.0/8",
    # "*.engines.internal"]): each URL's host, and a tcp:// KV endpoint's host, must be an
    # IP in one of the CIDRs or a name matching one of the globs (no DNS lookups); ipc://
    # endpoints are then refused. Empty: any. Configured and --backend URLs are not checked
    admin_allowed_backends: tuple[str, ...] = ()
    # a non-streaming request to a vLLM backend goes upstream as a stream and comes back
    # as one assembled JSON body, so its first token is seen (learned prefill rates,
    # queued prefill released at the first token); False: the original bytes, always
    assemble_non_streaming: bool = True
    sessions: SessionConfig = field(default_factory=SessionConfig)  # YAML section "sessions:"

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "port", f"must be in [0, 65535], got {self.port}")
        _check(isinstance(self.assemble_non_streaming, bool), "assemble_non_streaming",
               "must be a bool")  # fmt: skip
        modes = ("approximate", "exact", "auto")
        _check(self.mode in (None, *modes), "mode", f"must be one of {modes}, got {self.mode!r}")
        _check(0 <= self.speculative_ttl_s <= 600, "speculative_ttl_s", "must be in [0, 600]")
        _check(isinstance(self.tokenizers, Mapping), "tokenizers", "must map model -> path")
        for model, path in self.tokenizers.items():
            ok = isinstance(model, str) and isinstance(path, str) and bool(model and path)
            _check(ok, "tokenizers", f"entry {model!r}: {path!r} is not model name -> path")
        _check(bool(self.policy), "policy", "must not be empty")
        _check(0 <= self.drain_timeout_s <= 3600, "drain_timeout_s", "must be in [0, 3600]")
        urls = [b.url for b in self.backends]
        _check(len(urls) == len(set(urls)), "backends", "duplicate backend URL")
        backend_names = [b.name for b in self.backends if b.name is not None]
        unique = len(backend_names) == len(set(backend_names))
        _check(unique, "backends", "duplicate backend name")
        _check(isinstance(self.expose_backend_urls, bool), "expose_backend_urls", "must be a bool")
        names = [k.key for k in self.client_keys]
        _check(len(names) == len(set(names)), "clients.keys", "duplicate key")
        if self.admin_key is not None:
            _check(len(self.admin_key) >= 8, "admin_key", "must be >= 8 characters")
        allowed = tuple(check_backend_pattern(p) for p in self.admin_allowed_backends)
        object.__setattr__(self, "admin_allowed_backends", allowed)
        server = self.server
        if server.metrics_auth:
            _check(self.admin_key is not None, "server.metrics_auth", "needs admin_key")
        if server.admin_port is not None and server.admin_port != 0:
            same_host = (server.admin_host or self.host) == self.host
            _check(not same_host or server.admin_port != self.port, "server.admin_port",
                   "must differ from port")  # fmt: skip

    @property
    def resolved_mode(self) -> str:
        """``mode``, or its default: "auto" when a backend has KV events, else "approximate"."""
        if self.mode is not None:
            return self.mode
        return "auto" if any(b.kv_events for b in self.backends) else "approximate"


def _section(cls: type, raw: Any, name: str) -> Any:
    if raw is None:
        return cls()
    _check(isinstance(raw, Mapping), name, "must be a mapping")
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    _check(not unknown, name, f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _backend(raw: Any) -> BackendConfig:
    if isinstance(raw, str):
        return BackendConfig(url=raw)
    return _section(BackendConfig, raw, "backends[]")


def _expand(value: Any) -> Any:
    """``env:NAME`` reads a secret from the environment (keys need not sit in the YAML)."""
    if isinstance(value, str) and value.startswith("env:"):
        name = value[4:]
        _check(name in os.environ, value, "environment variable not set")
        return os.environ[name]
    return value


def config_from_mapping(raw: Mapping[str, Any]) -> RouterConfig:
    """A RouterConfig from the parsed YAML document; ValueError names the bad field."""
    known = {f.name for f in fields(RouterConfig)} - {"client_keys"} | {"clients"}
    unknown = set(raw) - known
    _check(not unknown, "config", f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    backends = raw.get("backends") or []
    _check(isinstance(backends, list), "backends", "must be a list")
    clients = raw.get("clients") or {}
    _check(isinstance(clients, Mapping), "clients", "must be a mapping with 'keys'")
    keys_raw = clients.get("keys") or []
    _check(isinstance(keys_raw, list), "clients.keys", "must be a list")
    keys = []
    for k in keys_raw:
        _check(isinstance(k, Mapping), "clients.keys[]", "must be a mapping")
        keys.append(_section(ClientKey, {**k, "key": _expand(k.get("key"))}, "clients.keys[]"))
    proxies = []
    for p in raw.get("trusted_proxies") or []:
        try:
            proxies.append(ipaddress.ip_network(str(p), strict=False))
        except ValueError as exc:
            raise ValueError(f"trusted_proxies: {exc}") from None
    scalars = {
        k: _expand(raw[k])
        for k in (
            "policy",
            "host",
            "port",
            "admin_key",
            "drain_timeout_s",
            "log_prompts",
            "expose_backend_urls",
            "mode",
            "speculative_ttl_s",
            "assemble_non_streaming",
        )
        if k in raw
    }
    allowed = raw.get("admin_allowed_backends") or []
    _check(isinstance(allowed, list), "admin_allowed_backends", "must be a list")
    tokenizers = raw.get("tokenizers") or {}
    _check(isinstance(tokenizers, Mapping), "tokenizers", "must map model name -> path")
    backend_list = []
    for b in backends:
        if isinstance(b, Mapping) and "api_key" in b:
            b = {**b, "api_key": _expand(b["api_key"])}
        backend_list.append(_backend(b))
    return RouterConfig(
        backends=tuple(backend_list),
        timeouts=_section(TimeoutConfig, raw.get("timeouts"), "timeouts"),
        limits=_section(LimitConfig, raw.get("limits"), "limits"),
        health=_section(HealthConfig, raw.get("health"), "health"),
        breaker=_section(BreakerConfig, raw.get("breaker"), "breaker"),
        server=_section(ServerConfig, raw.get("server"), "server"),
        sessions=_section(SessionConfig, raw.get("sessions"), "sessions"),
        admin_allowed_backends=tuple(str(p) for p in allowed),
        client_keys=tuple(keys),
        trusted_proxies=tuple(proxies),
        tokenizers=dict(tokenizers),
        **scalars,
    )


def parse_pairs(items: Sequence[str], name: str) -> dict[str, str]:
    """``KEY=VALUE`` flags (``--kv-events URL=tcp://h:p``) -> dict; split at the last '='
    for endpoints, so a URL key keeps any '=' of its own."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.rpartition("=")
        _check(bool(sep and key and value), name, f"expected KEY=VALUE, got {item!r}")
        out[key.strip().rstrip("/")] = value.strip()
    return out


def with_kv_endpoints(
    backends: Sequence[BackendConfig],
    kv_events: Mapping[str, str],
    kv_replay: Mapping[str, str] | None = None,
) -> tuple[BackendConfig, ...]:
    """Backends with the flag-given KV endpoints set (URL -> endpoint); a URL that is not a
    backend is a ValueError."""
    kv_replay = kv_replay or {}
    by_url = {b.url: b for b in backends}
    for flag, given in (("--kv-events", kv_events), ("--kv-replay", kv_replay)):
        for url in given:
            _check(normalize_url(url) in by_url, flag, f"{url} is not a --backend / config URL")
    out = []
    for b in backends:
        events = _lookup(kv_events, b.url) or b.kv_events
        replay = _lookup(kv_replay, b.url) or b.kv_replay
        out.append(replace(b, kv_events=events, kv_replay=replay))
    return tuple(out)


def _lookup(given: Mapping[str, str], url: str) -> str | None:
    for key, value in given.items():
        if normalize_url(key) == url:
            return value
    return None


def load_config(
    path: str | Path | None = None,
    *,
    backends: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    kv_events: Mapping[str, str] | None = None,
    kv_replay: Mapping[str, str] | None = None,
    tokenizers: Mapping[str, str] | None = None,
) -> RouterConfig:
    """YAML file (optional) + ``--backend`` URLs + flag overrides -> one RouterConfig.

    Flags win over the file; ``--backend`` URLs are added to the file's backends.
    ``overrides`` holds top-level RouterConfig fields whose value is not None.
    ``kv_events`` / ``kv_replay`` map backend URL -> endpoint (``--kv-events URL=EP``);
    ``tokenizers`` model -> path, added to the file's.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        _check(isinstance(loaded, Mapping), str(path), "top level must be a mapping")
        raw = dict(loaded)
    config = config_from_mapping(raw)
    extra = tuple(BackendConfig(url=u) for u in backends)
    changes: dict[str, Any] = {k: v for k, v in (overrides or {}).items() if v is not None}
    if extra or kv_events or kv_replay:
        all_backends = config.backends + extra
        changes["backends"] = with_kv_endpoints(all_backends, kv_events or {}, kv_replay)
    if tokenizers:
        changes["tokenizers"] = {**config.tokenizers, **tokenizers}
    return replace(config, **changes) if changes else config
