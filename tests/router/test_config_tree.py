"""One configuration tree (router -> fleet -> cost, policies.<name>) from YAML and flags:
it reaches the Fleet and changes its decisions, ``--print-config`` shows it, and a bad
key is an error that names its full path, exit 2, no traceback."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.cli import main
from kvroute.core.config import KeyKind, Mode
from kvroute.core.fleet import Fleet
from kvroute.core.policy import Decision, Reason
from kvroute.router.app import build_fleet
from kvroute.router.cli import add_parser, config_from_args
from kvroute.router.config import RouterConfig, config_from_mapping, load_config, read_yaml
from kvroute.router.config_print import config_to_mapping, dump_config
from tests.core.routing_helpers import chain, req, serve, url

# a cost-model constant, the index cap and two parameters of the prefix policy
MUST_SHOW_YAML = """
policy: prefix
policies:
  prefix: {num_least_loaded: 1, num_hashed: 0}
fleet:
  max_index_entries: 4
  cost: {divert_margin_s: 10.0}
"""


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def write(tmp_path: Path, text: str, name: str = "router.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def fleet_of(config: RouterConfig, n: int) -> Fleet:
    """The Fleet the router builds from ``config`` (as make_app does), with n backends."""
    fleet = build_fleet(config.policy, config.policy_params, config.fleet)
    for i in range(n):
        fleet.add_backend(url(i))
    return fleet


def busy_holder(config: RouterConfig) -> Decision:
    """A short shared prefix on a holder with 5 s of queued prefill: worth leaving?"""
    fleet = fleet_of(config, 2)
    shared = chain((1, 2))
    first, _ = serve(fleet, req("a", shared + chain((2, 1))))
    big = req("big", chain((9, 1)), prompt_tokens=50_000)
    fleet.dispatch(Decision(first.backend, Reason.LOAD, 0, (first.backend,)), big, 0.0)
    decision, _ = serve(fleet, req("b", shared + chain((3, 1))), now=0.1)
    return decision


def long_prefix_hit(config: RouterConfig) -> Decision:
    """An 8-block prefix served, then asked for again."""
    fleet = fleet_of(config, 2)
    prefix = chain((1, 8))
    _, ticket = serve(fleet, req("a", prefix + chain((2, 1))))
    fleet.finish(ticket, 0.5, ok=True)
    decision, _ = serve(fleet, req("b", prefix + chain((3, 1))), now=1.0)
    return decision


def cold_placements(config: RouterConfig) -> list[str]:
    """Where four new prefixes go on four idle backends."""
    fleet = fleet_of(config, 4)
    return [serve(fleet, req(f"x{i}", chain((50 + i, 2))))[0].backend for i in range(4)]


def test_must_show_yaml_is_accepted_printed_and_changes_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, MUST_SHOW_YAML)
    assert main(["serve", "--config", path, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["fleet"]["max_index_entries"] == 4
    assert printed["fleet"]["cost"]["divert_margin_s"] == 10.0
    assert printed["policies"]["prefix"]["num_least_loaded"] == 1
    assert printed["policies"]["prefix"]["num_hashed"] == 0
    assert printed["fleet"]["cost"]["overhead_s"] == 0.015  # the rest: defaults

    custom = config_from_args(serve_args("--config", path))
    default = config_from_args(serve_args())
    fleet = fleet_of(custom, 1)
    assert fleet.index.max_entries == 4 and fleet.config.cost.divert_margin_s == 10.0
    # the cost constant: a 10 s margin keeps the request on the busy holder
    assert busy_holder(default).reason == Reason.LOAD
    assert busy_holder(custom).reason == Reason.PREFIX
    # the index cap: 4 entries hold only half of the 8-block prefix
    assert long_prefix_hit(default).predicted_cached_tokens == 8 * 16
    assert long_prefix_hit(custom).predicted_cached_tokens == 4 * 16
    # the policy's parameters: one least-loaded candidate and no hashed homes
    assert cold_placements(custom) != cold_placements(default)


def test_policy_args_are_typed_and_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "policy: least_load\npolicies: {least_load: {max_ties: 2}}\n")
    config = config_from_args(serve_args("--config", path, "--policy-arg", "ranked_limit=3"))
    assert (config.policy_params.max_ties, config.policy_params.ranked_limit) == (2, 3)
    flag = serve_args("--config", path, "--policy-arg", "max_ties=5", "--policy-arg", "max_ties=6")
    assert config_from_args(flag).policy_params.max_ties == 6  # the last one wins
    # the flags apply to the policy chosen by --policy, over the file's
    args = serve_args(
        "--config", path, "--policy", "consistent_hash", "--policy-arg", "epsilon=1e-3"
    )
    config = config_from_args(args)
    assert config.policy == "consistent_hash" and config.policy_params.epsilon == 0.001
    assert config.policies["least_load"].max_ties == 2  # the file's other section stays
    prefix = load_config(policy_args={"max_holders": " 8 "})
    assert prefix.policy == "prefix" and prefix.policy_params.max_holders == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy-arg", "max_holders"], "--policy-arg: expected KEY=VALUE, got 'max_holders'"),
        (["--policy-arg", "max_holders=abc"],
         "policies.prefix.max_holders: expected an integer, got 'abc'"),
        (["--policy-arg", "max_holders=0"], "policies.prefix.max_holders: must be >= 1, got 0"),
        (["--policy-arg", "max_holder=2"],
         "policies.prefix.max_holder: unknown key; did you mean 'max_holders'?"),
        (["--policy", "round_robin", "--policy-arg", "x=1"],
         "policies.round_robin.x: unknown key; there are none here"),
        (["--policy", "fastest"], "policy: unknown policy 'fastest'; known: "),
    ],
)  # fmt: skip
def test_bad_policy_flags_name_the_key(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute serve: {message}") and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fleet:\n  cost:\n    divert_margin_s: abc\n",
         "fleet.cost.divert_margin_s: expected a number, got 'abc'"),
        ("fleet: {cost: {divert_margn_s: 1}}", "fleet.cost.divert_margn_s: unknown key; did you"),
        ("fleet: {max_index_entries: 1.5}",
         "fleet.max_index_entries: expected an integer, got 1.5"),
        ("fleet: {speculative_ttl_s: 601}",
         "fleet.speculative_ttl_s: must be in [0, 600], got 601"),
        ("fleet: {mode: exact}", "fleet.mode: set by 'mode', not in fleet"),
        ("fleet: {session_ttl_s: 5}", "fleet.session_ttl_s: set by 'sessions.ttl_s'"),
        ("fleet: [1]", "fleet: expected a mapping, got [1]"),
        ("speculative_ttl_s: 1", "speculative_ttl_s: moved to fleet.speculative_ttl_s"),
        ("policies: {prefix: {max_holders: '4'}}",
         "policies.prefix.max_holders: expected an integer, got '4'"),
        ("policies: {fastest: {}}", "policies.fastest: unknown policy; known: "),
        ("policies: {prefix: [1]}", "policies.prefix: expected a mapping, got [1]"),
        ("mode: precise", "mode: expected one of approximate, exact, auto, got 'precise'"),
        ("polcy: prefix", "polcy: unknown key; did you mean 'policy'?"),
        ("backends: [{url: 1}]", "backends[0].url: expected a string, got 1"),
        ("backends: [{url: 'http://a', weight: x}]",
         "backends[0].weight: expected a number, got 'x'"),
        ("admin_key: 123456789", "admin_key: expected a string"),
        ("clients: {keys: [{name: a, key: 123456789}]}", "clients.keys[0].key: expected a string"),
        ("clients: {users: []}", "clients.users: unknown key; known: keys"),
        ("clients: {keys: [{name: a}]}", "clients.keys[0].key: missing (required)"),
        ("backends: [{weight: 2}]", "backends[0].url: missing (required)"),
        ("trusted_proxies: [10.0.0.0/8, nope]", "trusted_proxies[1]: 'nope' does not appear"),
        ("sessions: {max_entries: many}", "sessions.max_entries: expected an integer, got 'many'"),
        ("a: [", "router.yaml: not valid YAML (line 1): expected the node content"),
        ("- a\n", "router.yaml: top level must be a mapping"),
        ("backends: [http://a:1]\npolicy: prefix\nbackends: [http://b:1]\n",
         "router.yaml: not valid YAML (line 3): duplicate key 'backends' (first on line 1)"),
        ("timeouts:\n  idle_s: 30\n  idle_s: 5\n",
         "router.yaml: not valid YAML (line 3): duplicate key 'idle_s' (first on line 2)"),
        ("backends: [{url: 'http://a:1', weight: 2, weight: 3}]",
         "router.yaml: not valid YAML (line 1): duplicate key 'weight' (first on line 1)"),
        ("x: &t {policy: prefix}\npolicies:\n  prefix: {}\n  prefix: {}\n",
         "router.yaml: not valid YAML (line 4): duplicate key 'prefix' (first on line 3)"),
    ],
)  # fmt: skip
def test_bad_yaml_names_the_full_key_exit_2_no_traceback(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, text)
    assert main(["serve", "--config", path, "--backend", "http://a:1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    got = err.removeprefix("kvroute serve: ").removeprefix(str(tmp_path) + "/")
    assert got.startswith(message), err


def test_yaml_merge_keys_may_be_overridden(tmp_path: Path) -> None:
    """``<<: *anchor`` then the same key is an override, not a duplicate key, also when
    the merged mapping is itself merged later (PyYAML rewrites merged nodes in place)."""
    text = """
x-timeouts: &t {connect_s: 2, idle_s: 30}
x-more: {inner: &m {<<: *t, idle_s: 40}}
timeouts: {<<: *m, total_s: 100}
backends:
  - &b {url: 'http://a:1', weight: 2}
  - {<<: *b, url: 'http://b:1'}
"""
    raw = read_yaml(write(tmp_path, text))
    assert raw["timeouts"] == {"connect_s": 2, "idle_s": 40, "total_s": 100}
    assert raw["backends"][1] == {"url": "http://b:1", "weight": 2}


def _leaves(tree: Any, path: str = "") -> Iterator[str]:
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            yield from _leaves(value, f"{path}.{key}" if path else key)
    elif path:
        yield path


def _set(tree: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    *parents, last = path.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return tree


@pytest.mark.parametrize("leaf", sorted(_leaves(config_to_mapping(RouterConfig()))))
def test_every_key_of_the_tree_refuses_a_wrong_type_by_name(leaf: str) -> None:
    """Each key of the printed defaults, given a value of no key's type, is a ValueError
    whose message starts with that key (or an item of it), never another exception."""
    with pytest.raises(ValueError) as err:
        config_from_mapping(_set({}, leaf, [{"x": []}]))
    assert str(err.value).startswith(leaf), str(err.value)


def test_print_config_loads_back_as_the_same_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = """
backends:
  - {url: 'http://a:1', kv_events: 'tcp://127.0.0.1:5557', name: gpu-a, weight: 2}
  - http://b:1
policy: consistent_hash
policies: {consistent_hash: {epsilon: 0.5}, prefix: {max_holders: 2}}
mode: exact
fleet: {default_block_size: 32, cost: {overhead_s: 0.02}}
sessions: {headers: [X-Conv], ttl_s: 60}
trusted_proxies: [10.0.0.0/8]
tokenizers: {m: /models/m}
"""
    path = write(tmp_path, text)
    assert main(["serve", "--config", path, "--print-config"]) == 0
    printed = capsys.readouterr().out
    again = write(tmp_path, printed, "printed.yaml")
    assert load_config(again) == load_config(path)
    config = load_config(again)
    assert config.mode is Mode.EXACT and config.fleet.mode is Mode.EXACT
    assert config.fleet.session_ttl_s == 60 and config.fleet.cost.overhead_s == 0.02


def test_defaults_are_unchanged_and_secrets_are_not_printed(tmp_path: Path) -> None:
    config = load_config(None, backends=["http://a:1"])
    assert config.policy == "prefix" and config.resolved_mode is Mode.APPROXIMATE
    assert config.fleet.mode is Mode.APPROXIMATE and config.fleet.speculative_ttl_s == 3.0
    assert (config.fleet.session_ttl_s, config.fleet.session_max_entries) == (600.0, 100_000)
    assert config.fleet.max_index_entries == 0  # sized to the backends' caches
    assert config.policy_params.max_holders == 4
    text = "admin_key: admin-S3CR3T\nbackends: [{url: 'http://a:1', api_key: up-S3CR3T}]\n"
    text += "clients: {keys: [{name: t, key: client-S3CR3T}]}\n"
    printed = dump_config(load_config(write(tmp_path, text)))
    assert "S3CR3T" not in printed and printed.count("'***'") == 4  # with the header's


def test_printed_secrets_are_refused_or_round_trip_as_env_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A printed secret is never loaded as the literal placeholder (a backend would get
    "Bearer ***"); one that came from ``env:NAME`` is printed as that reference."""
    text = "admin_key: admin-S3CR3T\nbackends: [{url: 'http://a:1', api_key: up-S3CR3T}]\n"
    text += "clients: {keys: [{name: t, key: client-S3CR3T}]}\n"
    printed = dump_config(load_config(write(tmp_path, text)))
    with pytest.raises(ValueError, match="placeholder"):
        load_config(write(tmp_path, printed, "printed.yaml"))
    for bad in (
        "admin_key: '***'\n",
        "backends: [{url: 'http://a:1', api_key: '***'}]\n",
        "clients: {keys: [{name: t, key: '***'}]}\n",
    ):
        with pytest.raises(ValueError, match=r"placeholder '\*\*\*'.*env:NAME"):
            load_config(write(tmp_path, bad, "bad.yaml"))
    monkeypatch.setenv("UP_KEY", "up-S3CR3T")
    monkeypatch.setenv("ADMIN_KEY", "admin-S3CR3T")
    monkeypatch.setenv("CLIENT_KEY", "client-S3CR3T")
    text = "admin_key: env:ADMIN_KEY\nbackends: [{url: 'http://a:1', api_key: env:UP_KEY}]\n"
    text += "clients: {keys: [{name: t, key: env:CLIENT_KEY}]}\nmode: approximate\n"
    config = load_config(write(tmp_path, text))
    assert config.backends[0].api_key == "up-S3CR3T" and config.admin_key == "admin-S3CR3T"
    printed = dump_config(config)
    assert "S3CR3T" not in printed and "env:UP_KEY" in printed and "env:ADMIN_KEY" in printed
    assert load_config(write(tmp_path, printed, "printed.yaml")) == config


def test_enums_keep_their_strings_on_the_wire() -> None:
    assert json.dumps({"mode": Mode.AUTO, "reason": Reason.COLD}) == (
        '{"mode": "auto", "reason": "cold"}'
    )
    assert KeyKind.TOKENS == "tokens" and Reason.ROUND_ROBIN == "round_robin"
    assert config_from_mapping({"mode": "auto"}).mode is Mode.AUTO
    assert config_from_mapping({"backends": [{"url": "http://a:1", "kv_events": "tcp://h:1"}]})
    assert RouterConfig(mode="exact").fleet.mode is Mode.EXACT  # type: ignore[arg-type]
