"""Exact-mode configuration (YAML, flags, mode default) and the Fleet fixes the router
relies on (own in-flight count, a dead backend's stale engine gauges)."""

from __future__ import annotations

import argparse

import pytest

from kvroute.core.fleet import Fleet
from kvroute.core.policy import make_policy
from kvroute.core.policy.base import RouteRequest
from kvroute.router.cli import add_parser, config_from_args
from kvroute.router.config import config_from_mapping, load_config

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_yaml_backends_carry_kv_endpoints_and_mode_defaults_to_auto() -> None:
    config = config_from_mapping(
        {
            "backends": [
                {"url": A, "kv_events": "tcp://127.0.0.1:5557", "kv_replay": "tcp://h:5600"},
                B,
            ],
            "tokenizers": {"llama": "/models/llama"},
        }
    )
    assert config.backends[0].kv_events == "tcp://127.0.0.1:5557"
    assert config.backends[0].kv_replay == "tcp://h:5600"
    assert config.backends[1].kv_events is None
    assert config.mode is None and config.resolved_mode == "auto"
    assert dict(config.tokenizers) == {"llama": "/models/llama"}
    assert config_from_mapping({"backends": [A]}).resolved_mode == "approximate"
    assert config_from_mapping({"backends": [A], "mode": "exact"}).resolved_mode == "exact"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"backends": [{"url": A, "kv_events": "http://x:1"}]}, r"backends\[0\]\.kv_events"),
        ({"backends": [{"url": A, "kv_replay": "tcp://h:1"}]}, r"backends\[0\]\.kv_replay"),
        ({"backends": [{"url": A, "kv_events": "tcp://127.0.0.1"}]}, "tcp://host:port"),
        ({"backends": [{"url": A, "kv_events": "tcp://:5557"}]}, "tcp://host:port"),
        ({"backends": [{"url": A, "kv_events": "tcp://h:99999"}]}, "port must be 1-65535"),
        ({"backends": [{"url": A, "kv_events": "tcp://h:0"}]}, "port must be 1-65535"),
        ({"backends": [{"url": A, "kv_events": "tcp://h:*"}]}, "port must be 1-65535"),
        (
            {"backends": [{"url": A, "kv_events": "tcp://h:1", "kv_replay": "tcp://h:x"}]},
            r"backends\[0\]\.kv_replay.*port",
        ),
        ({"backends": [A], "mode": "magic"}, "mode"),
        ({"backends": [A], "fleet": {"speculative_ttl_s": -1}}, r"fleet\.speculative_ttl_s"),
        ({"backends": [A], "tokenizers": ["x"]}, "tokenizers"),
    ],
    ids=[
        "events-not-zmq",
        "replay-without-events",
        "no-port",
        "no-host",
        "port-too-big",
        "port-0",
        "port-wildcard",
        "replay-port-not-a-number",
        "unknown-mode",
        "negative-ttl",
        "list",
    ],
)
def test_bad_exact_config_names_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        config_from_mapping(raw)


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5557", "tcp://engine-1.local:1", "tcp://[::1]:65535",
     "tcp://eth0;10.0.0.2:5557", " tcp://h:5557 ", "ipc:///tmp/kv.sock"],
)  # fmt: skip
def test_connectable_zmq_endpoints_are_accepted(endpoint: str) -> None:
    config = config_from_mapping({"backends": [{"url": A, "kv_events": endpoint}]})
    assert config.backends[0].kv_events == endpoint.strip()


def test_flags_give_endpoints_per_backend_url() -> None:
    args = serve_args(
        "--backend", A, "--backend", B + "/",
        "--kv-events", f"{A}=tcp://127.0.0.1:5557",
        "--kv-events", f"{B}/=tcp://127.0.0.1:5558",
        "--kv-replay", f"{A}=tcp://127.0.0.1:5600",
        "--tokenizer", "org/model=/m/path", "--mode", "exact",
    )  # fmt: skip
    config = config_from_args(args)
    assert [(b.url, b.kv_events, b.kv_replay) for b in config.backends] == [
        (A, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"),
        (B, "tcp://127.0.0.1:5558", None),
    ]
    assert config.mode == "exact" and dict(config.tokenizers) == {"org/model": "/m/path"}


def test_endpoint_for_an_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="--kv-events"):
        load_config(backends=[A], kv_events={B: "tcp://127.0.0.1:5558"})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        config_from_args(serve_args("--backend", A, "--kv-events", "tcp://127.0.0.1:5557"))


def request(n: int) -> RouteRequest:
    return RouteRequest("r", None, list(range(1, n // 16 + 1)), n, 8)


def test_unhealthy_backend_drops_its_scraped_engine_gauges() -> None:
    fleet = Fleet(make_policy("least_load"))
    fleet.add_backend(A)
    fleet.update_engine_stats(A, num_running=7, num_waiting=5, kv_cache_usage=0.9)
    (s,) = fleet.backend_states()
    assert s.in_flight_requests == 12 and s.own_in_flight_requests == 0
    fleet.set_healthy(A, False)
    (s,) = fleet.backend_states()
    assert (s.engine_num_running, s.engine_num_waiting, s.kv_cache_usage) == (None, None, None)
    assert s.in_flight_requests == 0 and s.in_flight_tokens == 0
    fleet.check_invariants()


def test_own_in_flight_count_and_a_backend_added_unhealthy() -> None:
    fleet = Fleet(make_policy("least_load"))
    fleet.add_backend(A)
    fleet.add_backend(B, healthy=False)
    req = request(64)
    decision = fleet.route(req, 0.0)
    assert decision is not None and decision.backend == A  # B takes nothing until healthy
    ticket = fleet.dispatch(decision, req, 0.0)
    fleet.update_engine_stats(A, num_running=0, num_waiting=9)
    state = {s.url: s for s in fleet.backend_states()}
    assert state[A].own_in_flight_requests == 1 and state[A].in_flight_requests == 9
    assert not state[B].healthy
    fleet.finish(ticket, 1.0, ok=True)
    assert fleet.backend_states()[0].own_in_flight_requests == 0
    fleet.check_invariants()


def test_predicted_cached_tokens_are_whole_blocks_within_prompt_minus_one() -> None:
    fleet = Fleet(make_policy("prefix"))
    fleet.add_backend(A)
    req = request(64)  # exactly 4 blocks of 16
    ticket = fleet.dispatch(fleet.route(req, 0.0), req, 0.0)  # type: ignore[arg-type]
    fleet.finish(ticket, 0.1, ok=True)
    assert fleet.predicted_cached_tokens(A, req) == 48  # the engine recomputes the last block
    fleet.record_cached_tokens(fleet.dispatch(fleet.route(req, 1.0), req, 1.0), 48)  # type: ignore[arg-type]
    (s,) = fleet.backend_states()
    assert (s.num_reported, s.num_reported_exact, s.reported_predicted_tokens) == (1, 1, 48)
