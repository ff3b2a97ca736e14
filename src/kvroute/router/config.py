"""Router configuration: one tree of frozen dataclasses, one loader for YAML and flags.

The tree: ``RouterConfig`` (listen address, backends, keys, ...) holds its sections
(router/config_sections.py), the Fleet's settings as ``fleet`` (core/config.py) with the
cost model's as ``fleet.cost`` (core/cost.py), and every policy's parameters as
``policies.<name>`` (each policy's ``Params``, parsed by the policy's own factory).
Fields declare their type, default and range once (core/params.py), so a bad entry is a
``ValueError`` naming its full key (``fleet.cost.divert_margin_s: expected a number, got
'abc'``). ``load_config`` is the only place that reads YAML; flags win over the file
(``--policy-arg KEY=VALUE`` over ``policies.<policy>.KEY``). ``dump_config`` writes the
effective tree back as YAML (``kvroute serve --print-config``, router/config_print.py).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvroute.core.config import FleetConfig, Mode
from kvroute.core.params import (
    ConfigError,
    build,
    check_ranges,
    param,
    parse_text,
    parse_value,
)
from kvroute.core.policy import default_params, policy_class
from kvroute.router.config_sections import (
    DEFAULT_SESSION_HEADERS,
    BackendConfig,
    BreakerConfig,
    ClientKey,
    HealthConfig,
    LimitConfig,
    ServerConfig,
    SessionConfig,
    TimeoutConfig,
    backend_public_id,
    check,
    check_backend_pattern,
    check_zmq_endpoint,
    normalize_url,
)

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# FleetConfig fields the router sets from elsewhere in its tree (not in ``fleet:``)
FLEET_KEYS_SET_ELSEWHERE = {
    "mode": "mode",
    "session_ttl_s": "sessions.ttl_s",
    "session_max_entries": "sessions.max_entries",
}
DEFAULT_POLICY = "prefix"
REDACTED = "***"  # what --print-config prints for a secret not read from env:NAME


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvroute serve`` needs; built by ``load_config``."""

    SECTION = ""  # top level: its fields' keys are their names

    backends: tuple[BackendConfig, ...] = ()  # the static fleet; admin API adds more
    policy: str = DEFAULT_POLICY  # core policy name (core/policy registry)
    # every policy's parameters by name (``policies.<name>`` in YAML; missing: defaults)
    policies: Mapping[str, Any] = field(default_factory=default_params)
    host: str = "127.0.0.1"  # listen address
    port: int = param(8000, ge=0, le=65535)  # listen port (0 = any free port)
    # routing keys: "approximate" (text keys, cache models fed by dispatches), "exact"
    # (engine token keys, views from KV events), "auto" (token keys for a model while one
    # of its backends' event streams is synced). None: "auto" when a backend has
    # kv_events, else "approximate" (see ``resolved_mode``)
    mode: Mode | None = None
    # the Fleet's settings (index cap, speculative TTL, cost model); its mode and session
    # sizes are set here from ``mode`` and ``sessions`` (FLEET_KEYS_SET_ELSEWHERE)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    limits: LimitConfig = field(default_factory=LimitConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    client_keys: tuple[ClientKey, ...] = ()  # non-empty -> every API call needs a key
    trusted_proxies: tuple[IpNetwork, ...] = ()  # X-Forwarded-For believed only from these
    admin_key: str | None = None  # bearer token of /admin/...; None disables the admin API
    drain_timeout_s: float = param(30.0, ge=0, le=3600)  # shutdown: wait for in-flight
    log_prompts: bool = False  # prompts never logged unless set
    # False (--hide-backend-urls): clients never see backend URLs; x-kvroute-backend and
    # error messages carry each backend's public_id (its name, or "b-" + 8 hex digits)
    expose_backend_urls: bool = True
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
        check_ranges(self, "")
        policy_class(self.policy)  # ConfigError "policy: unknown policy ..." lists the names
        object.__setattr__(self, "policies", _full_policies(self.policies))
        if self.mode is not None:
            object.__setattr__(self, "mode", parse_value(Mode, self.mode, "mode"))
        # the Fleet's mode and session sizes come from here, so config.fleet is what it gets
        fleet = replace(self.fleet, mode=self.resolved_mode, session_ttl_s=self.sessions.ttl_s,
                        session_max_entries=self.sessions.max_entries)  # fmt: skip
        object.__setattr__(self, "fleet", fleet)
        for model, path in self.tokenizers.items():
            ok = isinstance(model, str) and isinstance(path, str) and bool(model and path)
            check(ok, "tokenizers", f"entry {model!r}: {path!r} is not model name -> path")
        urls = [b.url for b in self.backends]
        twice = [u for i, u in enumerate(urls) if u in urls[:i]]
        if twice:  # after normalize_url, so one engine under two spellings is caught
            raise ConfigError("backends", f"duplicate backend URL {twice[0]}")
        names = [b.name for b in self.backends if b.name is not None]
        check(len(names) == len(set(names)), "backends", "duplicate backend name")
        keys = [k.key for k in self.client_keys]
        check(len(keys) == len(set(keys)), "clients.keys", "duplicate key")
        if self.admin_key is not None:
            check(len(self.admin_key) >= 8, "admin_key", "must be >= 8 characters")
        allowed = tuple(check_backend_pattern(p) for p in self.admin_allowed_backends)
        object.__setattr__(self, "admin_allowed_backends", allowed)
        server = self.server
        if server.metrics_auth:
            check(self.admin_key is not None, "server.metrics_auth", "needs admin_key")
        if server.admin_port is not None and server.admin_port != 0:
            same_host = (server.admin_host or self.host) == self.host
            check(not same_host or server.admin_port != self.port, "server.admin_port",
                  "must differ from port")  # fmt: skip

    @property
    def resolved_mode(self) -> Mode:
        """``mode``, or its default: "auto" when a backend has KV events, else "approximate"."""
        if self.mode is not None:
            return self.mode
        return Mode.AUTO if any(b.kv_events for b in self.backends) else Mode.APPROXIMATE

    @property
    def policy_params(self) -> Any:
        """The chosen policy's parameters (its ``Params``)."""
        return self.policies[self.policy]


def _full_policies(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every policy's parameters: ``given`` (Params, or mappings to parse) over defaults."""
    out = default_params()
    for name, params in given.items():
        cls = policy_class(name) if name in out else None
        if cls is None:
            raise ConfigError(f"policies.{name}", f"unknown policy; known: {', '.join(out)}")
        if not isinstance(params, cls.Params):
            params = cls.parse_params(params, f"policies.{name}")
        out[name] = params
    return out


# --- YAML -> RouterConfig ------------------------------------------------------------


class EnvSecret(str):
    """A secret read from ``env:NAME``: a plain string to every user, and its ``ref``
    (``"env:NAME"``) for ``--print-config`` to print instead of the value."""

    ref: str

    def __new__(cls, value: str, ref: str) -> EnvSecret:
        out = super().__new__(cls, value)
        out.ref = ref
        return out

    def __reduce__(self) -> tuple[type[EnvSecret], tuple[str, str]]:
        return EnvSecret, (str(self), self.ref)  # through a worker process's pickling


def _expand(value: Any) -> Any:
    """``env:NAME`` reads a secret from the environment (keys need not sit in the YAML)."""
    if isinstance(value, str) and value.startswith("env:"):
        name = value[4:]
        check(name in os.environ, value, "environment variable not set")
        return os.environ[name]
    return value


def _secret(value: Any, key: str) -> str | None:
    """A secret from YAML (``env:`` expanded, remembering its reference); a wrong type is
    named, never shown; ``--print-config``'s placeholder is refused, not taken as the key."""
    secret = _expand(value)
    if secret is None:
        return None
    if not isinstance(secret, str):
        raise ConfigError(key, "expected a string")
    check(secret != REDACTED, key, f"is the placeholder {REDACTED!r} that --print-config "
          "writes for a secret: put the real value or env:NAME back")  # fmt: skip
    return EnvSecret(secret, value) if secret is not value else secret  # value: "env:NAME"


def _items(raw: Any, key: str) -> list[Any]:
    if raw is None:
        return []
    check(isinstance(raw, list), key, f"expected a list, got {type(raw).__name__}")
    return list(raw)


def _backend(raw: Any, key: str) -> BackendConfig:
    if isinstance(raw, str):
        raw = {"url": raw}
    check(isinstance(raw, Mapping), key, "expected a URL or a mapping with url")
    if "api_key" in raw:
        raw = {**raw, "api_key": _secret(raw["api_key"], f"{key}.api_key")}
    return build(BackendConfig, raw, key)


def _client_key(raw: Any, key: str) -> ClientKey:
    check(isinstance(raw, Mapping), key, "expected a mapping with name and key")
    if "key" in raw:
        raw = {**raw, "key": _secret(raw["key"], f"{key}.key")}
    return build(ClientKey, raw, key)


def _proxy(raw: Any, key: str) -> IpNetwork:
    try:
        return ipaddress.ip_network(str(raw), strict=False)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _client_keys(raw: Any) -> tuple[ClientKey, ...]:
    """The ``clients:`` section (``keys:``, a list of name/key/limits)."""
    clients = raw or {}
    check(isinstance(clients, Mapping), "clients", "expected a mapping with 'keys'")
    for key in clients:
        check(key == "keys", f"clients.{key}", "unknown key; known: keys")
    keys = _items(clients.get("keys"), "clients.keys")
    return tuple(_client_key(k, f"clients.keys[{i}]") for i, k in enumerate(keys))


def config_from_mapping(raw: Mapping[str, Any]) -> RouterConfig:
    """A RouterConfig from the parsed YAML document; ConfigError names the bad key."""
    raw = dict(raw)
    check("speculative_ttl_s" not in raw, "speculative_ttl_s", "moved to fleet.speculative_ttl_s")
    fleet = raw.get("fleet")
    if isinstance(fleet, Mapping):
        for key, home in FLEET_KEYS_SET_ELSEWHERE.items():
            check(key not in fleet, f"fleet.{key}", f"set by {home!r}, not in fleet")
    backends = _items(raw.pop("backends", None), "backends")
    given = {
        "backends": tuple(_backend(b, f"backends[{i}]") for i, b in enumerate(backends)),
        "client_keys": _client_keys(raw.pop("clients", None)),
        "trusted_proxies": tuple(
            _proxy(p, f"trusted_proxies[{i}]")
            for i, p in enumerate(_items(raw.pop("trusted_proxies", None), "trusted_proxies"))
        ),
    }
    if "admin_key" in raw:
        raw["admin_key"] = _secret(raw["admin_key"], "admin_key")
    raw = {k: _expand(v) if isinstance(v, str) else v for k, v in raw.items()}
    return build(RouterConfig, raw, "", given=given)


def parse_pairs(items: Sequence[str], name: str) -> dict[str, str]:
    """``KEY=VALUE`` flags (``--kv-events URL=tcp://h:p``) -> dict; split at the last '='
    for endpoints, so a URL key keeps any '=' of its own."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.rpartition("=")
        check(bool(sep and key and value), name, f"expected KEY=VALUE, got {item!r}")
        out[key.strip().rstrip("/")] = value.strip()
    return out


def parse_policy_args(items: Sequence[str]) -> dict[str, str]:
    """``--policy-arg KEY=VALUE`` flags -> {KEY: VALUE text}; split at the first '='."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        check(bool(sep and key.strip()), "--policy-arg", f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
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
            check(normalize_url(url) in by_url, flag, f"{url} is not a --backend / config URL")
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (YAML says keys are
    unique; PyYAML keeps the last, so a merge mistake could drop half the fleet unseen).
    A key after ``<<: *anchor`` overrides the merged one, as YAML's merge key allows."""

    def construct_document(self, node: yaml.Node) -> Any:
        # checked on the composed tree, before construction rewrites merged mappings
        self._check_unique_keys(node)
        return super().construct_document(node)

    def _check_unique_keys(self, root: yaml.Node) -> None:
        todo, done = [root], set()
        while todo:
            node = todo.pop()
            if id(node) in done:  # an alias, or a recursive document
                continue
            done.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                todo.extend(node.value)
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[Any, yaml.Node] = {}
            for key_node, value_node in node.value:
                todo.append(value_node)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: construction refuses it
                    continue
                if seen is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None,
                        f"duplicate key {key!r} (first on line {seen.start_mark.line + 1})",
                        key_node.start_mark,
                    )  # fmt: skip


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML document at ``path`` (a mapping); ConfigError for bad YAML (a duplicate
    key included), OSError for an unreadable file."""
    try:
        loaded = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        problem = getattr(exc, "problem", None) or exc
        raise ConfigError(str(path), f"not valid YAML{line}: {problem}") from None
    check(isinstance(loaded, Mapping), str(path), "top level must be a mapping")
    return dict(loaded)


def _with_policy_args(raw: dict[str, Any], policy: str, args: Mapping[str, str]) -> None:
    """Put ``--policy-arg`` values into ``raw["policies"][policy]`` (flags over YAML),
    each read as its parameter's type (ConfigError ``policies.<policy>.<KEY>``)."""
    cls = policy_class(policy)
    section = raw.get("policies") or {}
    check(isinstance(section, Mapping), "policies", "expected a mapping of policy -> parameters")
    own = section.get(policy) or {}
    check(isinstance(own, Mapping), f"policies.{policy}", "expected a mapping")
    path = f"policies.{policy}"
    values = {k: parse_text(cls.Params, k, text, path) for k, text in args.items()}
    raw["policies"] = {**section, policy: {**own, **values}}


def load_config(
    path: str | Path | None = None,
    *,
    backends: Sequence[str] = (),
    overrides: Mapping[str, Any] | None = None,
    kv_events: Mapping[str, str] | None = None,
    kv_replay: Mapping[str, str] | None = None,
    tokenizers: Mapping[str, str] | None = None,
    policy_args: Mapping[str, str] | None = None,
) -> RouterConfig:
    """YAML file (optional) + ``--backend`` URLs + flag overrides -> one RouterConfig.

    Flags win over the file; ``--backend`` URLs are added to the file's backends.
    ``overrides`` holds top-level RouterConfig fields whose value is not None.
    ``kv_events`` / ``kv_replay`` map backend URL -> endpoint (``--kv-events URL=EP``);
    ``tokenizers`` model -> path, added to the file's; ``policy_args`` KEY -> text, the
    chosen policy's parameters (``--policy-arg``).
    """
    raw = read_yaml(path) if path is not None else {}
    changes: dict[str, Any] = {k: v for k, v in (overrides or {}).items() if v is not None}
    if policy_args:
        policy = changes.get("policy") or _expand(raw.get("policy")) or DEFAULT_POLICY
        check(isinstance(policy, str), "policy", f"expected a string, got {policy!r}")
        _with_policy_args(raw, policy, policy_args)
    config = config_from_mapping(raw)
    extra = tuple(BackendConfig(url=u) for u in backends)
    if extra or kv_events or kv_replay:
        all_backends = config.backends + extra
        changes["backends"] = with_kv_endpoints(all_backends, kv_events or {}, kv_replay)
    if tokenizers:
        changes["tokenizers"] = {**config.tokenizers, **tokenizers}
    return replace(config, **changes) if changes else config


__all__ = [
    "DEFAULT_SESSION_HEADERS",
    "REDACTED",
    "BackendConfig",
    "BreakerConfig",
    "ClientKey",
    "ConfigError",
    "EnvSecret",
    "HealthConfig",
    "IpNetwork",
    "LimitConfig",
    "RouterConfig",
    "ServerConfig",
    "SessionConfig",
    "TimeoutConfig",
    "backend_public_id",
    "check_backend_pattern",
    "check_zmq_endpoint",
    "config_from_mapping",
    "load_config",
    "normalize_url",
    "parse_pairs",
    "parse_policy_args",
    "with_kv_endpoints",
]
