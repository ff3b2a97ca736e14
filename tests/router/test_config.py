"""The config loader: YAML + flags -> frozen dataclasses; bad values name their field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvroute.router.config import BackendConfig, RouterConfig, TimeoutConfig, load_config

YAML = """
policy: round_robin
port: 9000
admin_key: env:TEST_ADMIN_KEY
backends:
  - url: http://a:8000/
    api_key: secret-a
    weight: 2
  - http://b:8000
timeouts: {connect_s: 1, first_byte_s: 30, idle_s: 5, total_s: 60}
limits: {max_body_bytes: 2048, max_attempts: 2}
breaker: {failure_threshold: 3}
clients:
  keys:
    - {name: team-a, key: sk-aaaaaaaa, max_concurrency: 4, rate_per_s: 10}
trusted_proxies: [10.0.0.0/8]
"""


def test_yaml_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_ADMIN_KEY", "admin-from-env")
    path = tmp_path / "router.yaml"
    path.write_text(YAML)
    cfg = load_config(path, backends=["http://c:8000"], overrides={"port": 9100, "host": None})
    assert [b.url for b in cfg.backends] == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert cfg.backends[0] == BackendConfig("http://a:8000", "secret-a", 2.0)
    assert cfg.port == 9100  # the flag wins
    assert cfg.host == "127.0.0.1"  # None flags change nothing
    assert cfg.admin_key == "admin-from-env"
    assert cfg.timeouts == TimeoutConfig(1, 30, 5, 60)
    assert cfg.limits.max_attempts == 2
    assert cfg.breaker.failure_threshold == 3
    assert cfg.client_keys[0].name == "team-a"
    assert str(cfg.trusted_proxies[0]) == "10.0.0.0/8"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("port: 70000", "port"),
        ("timeouts: {idle_s: 0}", "timeouts.idle_s"),
        # YAML 1.1 reads 3e3 as text: the message says how to write it
        (
            "timeouts: {idle_s: 3e3}",
            "timeouts.idle_s: expected a number, got '3e3' .text, "
            "not a number: write it 3000, unquoted.$",
        ),
        ("limits: {max_attempts: 0}", "limits.max_attempts"),
        ("backends: [ftp://x]", "backends[0].url"),
        ("backends: [{url: 'http://a', weight: 0}]", "backends[0].weight"),
        ("backends: [{url: 'http://a', weight: 1000000}]", "backends[0].weight"),
        ("policies: {consistent_hash: {virtual_nodes: 3000000}}", "policies.consistent_hash"),
        ("backends: [http://a, http://a/]", "backends"),
        ("timeout: {}", "timeout"),
        ("limits: {max_body: 1}", "limits"),
        ("trusted_proxies: [not-an-ip]", "trusted_proxies"),
        ("clients: {keys: [{name: x, key: short}]}", "clients.keys[x].key"),
        ("admin_key: env:KVROUTE_SURELY_UNSET_VAR", "env:KVROUTE_SURELY_UNSET_VAR"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{field.replace('[', '.').replace(']', '.')}"):
        load_config(path)


def test_defaults_without_file() -> None:
    cfg = load_config(None, backends=["http://x:1"])
    assert cfg == RouterConfig(backends=(BackendConfig("http://x:1"),))
