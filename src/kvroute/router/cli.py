"""``kvroute serve``: run the router (aiohttp on uvloop) until SIGINT/SIGTERM.

On a signal the listener closes, /health turns 503, and in-flight requests get up to
``drain_timeout_s`` to finish before the rest is cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from kvroute.router.app import make_app
from kvroute.router.config import RouterConfig, load_config, parse_policy_args
from kvroute.router.config_print import dump_config
from kvroute.router.kv_flags import add_kv_arguments, kv_load_kwargs
from kvroute.router.listener import ListenError, ensure_fd_limit, start_listeners

if TYPE_CHECKING:
    from kvroute.router.workers import SupervisorConfig

log = logging.getLogger("kvroute.router")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # --log-level, any case
NO_BACKENDS = "backends: give at least one --backend URL or a --config file that lists some"


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="run the KV-cache-aware router in front of OpenAI-compatible backends",
        description="OpenAI-compatible reverse proxy that routes by prefix-cache locality.",
    )
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="backend base URL (repeatable), e.g. http://127.0.0.1:8001")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="YAML config (backends, timeouts, keys...)")
    p.add_argument("--policy", help="routing policy (default from config, else 'prefix')")
    p.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of the chosen policy (repeatable), e.g. max_holders=8; "
                   "wins over the config's policies.<policy>.KEY; see --print-config")  # fmt: skip
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration (YAML) and exit")  # fmt: skip
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--admin-key", help="bearer key of /admin/... (or env KVROUTE_ADMIN_KEY)")
    p.add_argument("--drain-timeout", type=float, dest="drain_timeout_s",
                   help="seconds in-flight requests get to finish on shutdown")  # fmt: skip
    p.add_argument("--hide-backend-urls", dest="expose_backend_urls", action="store_const",
                   const=False, help="clients see backend ids (name or b-<hash>), never URLs, "
                   "in x-kvroute-backend and error messages")  # fmt: skip
    p.add_argument(
        "--keepalive",
        type=float,
        dest="keepalive_s",
        metavar="S",
        help="close idle keep-alive client connections after S seconds (75)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        dest="header_timeout_s",
        metavar="S",
        help="a request's headers must arrive within S seconds (10)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        dest="body_timeout_s",
        metavar="S",
        help="a request's body must arrive within S seconds of its headers (60)",
    )
    p.add_argument(
        "--max-client-connections",
        type=int,
        metavar="N",
        help="open client connections per process; more get 503 (4096)",
    )
    p.add_argument(
        "--admin-port",
        type=int,
        metavar="P",
        help="serve /, /metrics and /admin/... on this port only (0: any free)",
    )
    p.add_argument(
        "--admin-host",
        metavar="HOST",
        help="address of the --admin-port listener (default: --host)",
    )
    p.add_argument(
        "--metrics-auth",
        action="store_const",
        const=True,
        help="/ and /metrics need the admin key as a bearer token too",
    )
    p.add_argument(
        "--admin-allow",
        action="append",
        default=[],
        metavar="CIDR_OR_GLOB",
        help="hosts the admin API may add as backends (repeatable): a CIDR "
        "such as 10.0.0.0/8 or a name glob such as *.engines.internal",
    )
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin that may call the API (repeatable; '*' for any, "
                   "vLLM's default); none: no CORS")  # fmt: skip
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="router processes sharing the port via SO_REUSEPORT (default 1); "
                   "see docs/deploy.md")  # fmt: skip
    p.add_argument("--worker-port-base", type=int, metavar="P",
                   help="with --workers N: worker i also listens alone on port P+i "
                   "(per-worker /metrics and /admin)")  # fmt: skip
    p.add_argument("--no-worker-sync", dest="worker_sync", action="store_false",
                   help="with --workers N: workers do not tell each other their routing "
                   "decisions (each index sees only its own requests)")  # fmt: skip
    p.add_argument("--no-assemble-non-streaming", dest="assemble_non_streaming",
                   action="store_const", const=False, help="send non-streaming requests "
                   "to vLLM as they came, not as a stream answered as one body (the "
                   "router then sees no first token of theirs)")  # fmt: skip
    p.add_argument("--session-header", action="append", default=[], metavar="NAME",
                   help="request header naming the client session (repeatable, first "
                   "present wins; replaces the configured list)")  # fmt: skip
    p.add_argument("--no-session-hints", dest="session_hints", action="store_false",
                   help="ignore session headers and the body's user field")  # fmt: skip
    p.add_argument("--log-level", default="WARNING", type=str.upper, choices=LOG_LEVELS,
                   help="python logging level (default WARNING)")  # fmt: skip
    add_kv_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    overrides = {
        "policy": args.policy,
        "host": args.host,
        "port": args.port,
        "admin_key": args.admin_key or os.environ.get("KVROUTE_ADMIN_KEY"),
        "drain_timeout_s": args.drain_timeout_s,
        "mode": args.mode,
        "expose_backend_urls": args.expose_backend_urls,
        "assemble_non_streaming": args.assemble_non_streaming,
    }
    if args.admin_allow:
        overrides["admin_allowed_backends"] = tuple(args.admin_allow)
    kv = kv_load_kwargs(args)
    policy_args = parse_policy_args(args.policy_arg)
    config = load_config(
        args.config, backends=args.backend, overrides=overrides, policy_args=policy_args, **kv
    )
    config = _with_session_flags(config, args)
    server_flags = {
        name: getattr(args, name)
        for name in ("keepalive_s", "header_timeout_s", "body_timeout_s",
                     "max_client_connections", "admin_port", "admin_host", "metrics_auth")
        if getattr(args, name) is not None
    }  # fmt: skip
    if args.cors_origin:
        server_flags["cors_origins"] = tuple(args.cors_origin)
    if not server_flags:
        return config
    return replace(config, server=replace(config.server, **server_flags))


def _with_session_flags(config: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    sessions = config.sessions
    if args.session_header:
        sessions = replace(sessions, headers=tuple(args.session_header))
    if not args.session_hints:
        sessions = replace(sessions, headers=(), use_user_field=False)
    return config if sessions is config.sessions else replace(config, sessions=sessions)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    try:
        config = config_from_args(args)
        sup = _supervisor_config(args)  # bad --workers flags fail --print-config too
        if args.print_config:
            print(dump_config(config), end="")
            if not config.backends:  # a valid fragment (compare --router-config takes one)
                print(f"kvroute serve: note: serve would refuse this: {NO_BACKENDS}",
                      file=sys.stderr)  # fmt: skip
            return 0
        if not config.backends:
            raise ValueError(NO_BACKENDS)
        if sup is not None:
            from kvroute.router.workers import run_workers

            return run_workers(config, sup)
    except (ValueError, OSError) as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    try:
        asyncio.run(serve(config))
    except (ValueError, ListenError) as exc:  # e.g. unknown policy, port in use
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    return 0


def _supervisor_config(args: argparse.Namespace) -> SupervisorConfig | None:
    """How ``--workers N`` runs (router/workers.py); None for one process; ValueError on
    bad flags."""
    if args.workers == 1 and args.worker_port_base is None:
        return None
    from kvroute.router.workers import SupervisorConfig

    return SupervisorConfig(
        num_workers=args.workers,
        private_port_base=args.worker_port_base,
        log_level=args.log_level,
        share_decisions=args.worker_sync,
    )


async def serve(config: RouterConfig, *, ready: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM; then drain."""
    ensure_fd_limit(config)
    listeners = await start_listeners(make_app(config), config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, port = listeners.api
    admin = (
        f"; admin on http://{listeners.admin[0]}:{listeners.admin[1]}" if listeners.admin else ""
    )
    print(
        f"kvroute serve: listening on http://{host}:{port} "
        f"({len(config.backends)} backends, policy {config.policy}{admin})",
        flush=True,
    )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.warning(
            "shutting down: draining in-flight requests (up to %ss)", config.drain_timeout_s
        )
        await listeners.runner.cleanup()
