"""``kvroute compare`` and ``kvroute demo``: router names, skipped peers, time scaling, the
table, and end to end on a tiny simulated fleet (real subprocesses on loopback)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.bench import compare as compare_mod
from kvroute.bench.compare import CompareConfig, RouterOutcome, run_compare_async
from kvroute.bench.compare_report import change, format_table
from kvroute.bench.load import default_load
from kvroute.bench.procs import RouterSpec, RouterUnavailable, parse_router, router_command
from kvroute.bench.runner import BenchResult
from kvroute.bench.timescale import TimeScaled, scale_load
from kvroute.bench.workloads import make_workload
from kvroute.cli import main
from tests.bench.test_cli import DESIGN_KEYS

# Small prompts: the tiny engines and the 2 cores stay fast.
SMALL_RANVIER = {"large_prefix_tokens": "120,160,300,400", "xlarge_min_tokens": "250"}
SMALL_ARGS = [f"--workload-arg={k}={v}" for k, v in SMALL_RANVIER.items()]


@pytest.mark.parametrize(
    ("name", "kind", "policy"),
    [
        ("round_robin", "kvroute", "round_robin"),
        ("least_load", "kvroute", "least_load"),
        ("power_of_two", "kvroute", "power_of_two"),
        ("consistent_hash", "kvroute", "consistent_hash"),
        ("kvroute", "kvroute", "prefix"),
        ("kvroute:least_load", "kvroute", "least_load"),
        ("sglang", "sglang", "cache_aware"),
        ("vllm-router", "vllm-router", "cache_aware"),
    ],
)
def test_parse_router_names(name, kind, policy):
    assert parse_router(name) == RouterSpec(name, kind, policy)


def test_kvroute_policy_args_are_checked_and_passed_as_flags():
    spec = parse_router("kvroute:prefix:max_holders=8:num_hashed=0")
    assert (spec.policy, spec.policy_args) == ("prefix", ("max_holders=8", "num_hashed=0"))
    cmd = router_command(spec, ["http://a:1"], 9)
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--policy-arg"] == list(spec.policy_args)
    with pytest.raises(ValueError, match=r"policies\.prefix\.max_holders: expected an integer"):
        parse_router("kvroute:prefix:max_holders=x")
    with pytest.raises(ValueError, match="policy: unknown policy 'fastest'"):
        parse_router("kvroute:fastest")
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_router("kvroute:least_load:max_ties")


def test_a_router_config_goes_to_kvroute_and_may_not_name_backends(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("fleet: {max_index_entries: 5}\n")
    bad.write_text("backends: [{url: 'http://x:1'}]\n")
    cmd = router_command(parse_router("kvroute"), ["http://a:1"], 9, config_path=str(good))
    assert cmd[cmd.index("--config") + 1] == str(good)
    with pytest.raises(ValueError, match="lists backends"):
        CompareConfig("gsp", ("kvroute",), router_config=str(bad))
    with pytest.raises(ValueError, match="No such file"):
        CompareConfig("gsp", ("kvroute",), router_config=str(tmp_path / "none.yaml"))
    with pytest.raises(ValueError, match="max_index_entries"):
        good.write_text("fleet: {max_index_entries: -1}\n")
        CompareConfig("gsp", ("kvroute",), router_config=str(good))


def test_a_router_config_whose_policy_or_mode_a_router_overrides_is_refused(tmp_path):
    """kvroute's command line names the router's policy (and kvroute-exact's mode), which
    win over the file: a file saying otherwise would be ignored without a word."""
    path = tmp_path / "r.yaml"
    path.write_text("policy: least_load\n")
    for router in ("kvroute", "round_robin", "sglang-cache-aware"):
        with pytest.raises(ValueError, match=f"sets policy: least_load, but the router {router}"):
            CompareConfig("gsp", ("sglang", router), router_config=str(path))
    CompareConfig("gsp", ("kvroute:least_load", "sglang"), router_config=str(path))
    path.write_text("mode: approximate\n")
    with pytest.raises(ValueError, match="sets mode: approximate"):
        CompareConfig("gsp", ("kvroute-exact",), router_config=str(path))
    CompareConfig("gsp", ("kvroute",), router_config=str(path))


def test_kvroute_exact_subscribes_to_every_backends_events():
    spec = parse_router("kvroute-exact")
    assert (spec.kind, spec.policy, spec.mode) == ("kvroute", "prefix", "exact")
    cmd = router_command(spec, ["http://a:1", "http://b:2"], 9, ["tcp://a:5", "tcp://b:6"])
    assert cmd[cmd.index("--mode") + 1] == "exact"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-events"] == [
        "http://a:1=tcp://a:5",
        "http://b:2=tcp://b:6",
    ]


@pytest.mark.parametrize("name", ["nginx", "", "sglang:cache_aware", "Round_Robin"])
def test_parse_router_unknown_name_is_a_value_error(name):
    with pytest.raises(ValueError, match="unknown router"):
        parse_router(name)


def test_compare_config_rejects_an_unknown_router_before_starting_anything():
    with pytest.raises(ValueError, match="unknown router"):
        CompareConfig("ranvier-stress", ("round_robin", "haproxy"))


def test_missing_peers_raise_router_unavailable(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # no vllm-router beside
    for name in ("sglang", "vllm-router"):
        with pytest.raises(RouterUnavailable, match="not installed"):
            router_command(parse_router(name), ["http://127.0.0.1:1"], 2)


def test_peer_commands_always_pass_a_prometheus_port(monkeypatch, tmp_path):
    exe = tmp_path / "vllm-router"
    exe.write_text("")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: str(exe))
    for name in ("sglang", "vllm-router"):
        cmd = router_command(parse_router(name), ["http://127.0.0.1:1"], 2)
        assert "--prometheus-port" in cmd and cmd[cmd.index("--policy") + 1] == "cache_aware"


# --- time scaling -------------------------------------------------------------------


@given(speedup=st.floats(0.1, 50), index=st.integers(0, 30))
def test_time_scaled_multiturn_divides_think_times_and_keeps_the_requests(speedup, index):
    inner = make_workload("multiturn", seed=3)
    scaled = TimeScaled(make_workload("multiturn", seed=3), speedup)
    a = [s for _, s in zip(range(index + 1), inner.requests(), strict=False)][-1]
    b = [s for _, s in zip(range(index + 1), scaled.requests(), strict=False)][-1]
    assert b.think_time_s == pytest.approx(a.think_time_s / speedup)
    assert (b.messages, b.max_tokens, b.request_id) == (a.messages, a.max_tokens, a.request_id)


def test_scale_load_divides_think_time_multiplies_rates_keeps_duration():
    load = default_load(make_workload("ranvier-stress"), duration_s=30.0)
    fast = scale_load(load, 4.0)
    assert fast.think_time_s == (0.125, 0.5) and fast.duration_s == 30.0
    open_load = scale_load(default_load(make_workload("gsp"), rates=(2.0,), mode="open"), 4.0)
    assert open_load.rates == (8.0,)
    with pytest.raises(ValueError):
        scale_load(load, 0.0)


# --- the table ----------------------------------------------------------------------


def _fake_result(name: str, hit: float, p99: float, rps: float) -> BenchResult:
    return BenchResult(
        {
            "router": name,
            "engine_prefix_hit_rate": hit,
            "router_stickiness": None,
            "median_ttft_ms": p99 / 2,
            "p99_ttft_ms": p99,
            "request_throughput": rps,
            "output_throughput": rps * 100,
            "backend_load_imbalance": 1.5,
            "failed": 0,
        }
    )


def test_table_gives_changes_against_round_robin_and_names_skipped_routers():
    outcomes = {
        "round_robin": RouterOutcome("round_robin", _fake_result("round_robin", 0.12, 6800, 5)),
        "kvroute": RouterOutcome("kvroute", _fake_result("kvroute", 0.97, 1000, 6.1)),
        "sglang": RouterOutcome("sglang", skipped="sglang-router is not installed"),
        "vllm-router": RouterOutcome("vllm-router", error="RuntimeError: exited (1)\nlog"),
    }
    text = format_table(outcomes)
    kv_line = next(line for line in text.splitlines() if line.startswith("kvroute"))
    assert "97.0 % (+85.0 pp)" in kv_line and "1000 (-85 %)" in kv_line
    assert "6.10 (+22 %)" in kv_line and "n/a" in kv_line  # stickiness not known
    assert "sglang       skipped: sglang-router is not installed" in text
    assert "vllm-router  failed: RuntimeError: exited (1)" in text


@pytest.mark.parametrize(
    ("value", "base", "kind", "expected"),
    [
        (0.5, 0.25, "rate", "+25.0 pp"),
        (50, 100, "rel", "-50 %"),
        (1, 0, "rel", ""),
        (3, 1, "count", ""),
    ],
)
def test_change(value, base, kind, expected):
    assert change(value, base, kind) == expected


# --- end to end ---------------------------------------------------------------------


def _refused(url: str) -> bool:
    """Nothing listens at ``url`` any more (its process was stopped)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_compare_two_routers_on_a_tiny_fleet_and_a_skipped_peer(monkeypatch, tmp_path):
    real = router_command

    def peerless(spec, backends, port, kv_endpoints=(), config_path=None):
        if spec.kind != "kvroute":
            raise RouterUnavailable(f"{spec.name} is not installed")
        return real(spec, backends, port, kv_endpoints, config_path)

    monkeypatch.setattr(compare_mod, "router_command", peerless)
    config = CompareConfig(
        "ranvier-stress",
        ("round_robin", "kvroute-exact", "sglang"),
        num_backends=2,
        profile="tiny",
        speedup=2.0,
        workload_overrides=SMALL_RANVIER,
        load_overrides={
            "num_users": 6,
            "think_time_s": (0.0, 0.05),
            "num_requests": 40,
            "num_warmup": 4,
        },
        log_dir=tmp_path / "logs",
        progress=False,
    )
    outcomes = await run_compare_async(config)
    assert list(outcomes) == ["round_robin", "kvroute-exact", "sglang"]
    assert outcomes["sglang"].skipped == "sglang is not installed"
    from kvroute.bench.compare_report import write_compare

    paths = write_compare(outcomes, tmp_path / "out", plots=False)
    data = json.loads(paths["compare"].read_text())
    assert data["sglang"] == {"router": "sglang", "skipped": "sglang is not installed"}
    for name in ("round_robin", "kvroute-exact"):
        result = data[name]
        assert set(result) >= DESIGN_KEYS
        assert result["router"] == name and result["completed"] == 40
        assert 0.0 <= result["engine_prefix_hit_rate"] <= 1.0
        assert result["config"]["speedup"] == 2.0 and result["config"]["num_backends"] == 2
        assert len(result["per_backend"]) == 2
    assert data["kvroute-exact"]["router_decisions"]  # kvroute says why it routed
    # and what it expected: the headers reach the records
    answered = [r for r in outcomes["kvroute-exact"].bench.records if r.ok]
    assert all(r.left_cached_tokens is not None for r in answered)
    assert all(r.predicted_cached_tokens is not None for r in answered)
    assert any(r.predicted_cached_tokens for r in answered)
    assert "--mode exact" in data["kvroute-exact"]["config"]["router_command"]
    assert (tmp_path / "out" / "kvroute-exact" / "result.json").exists()
    for name in ("round_robin", "kvroute-exact"):  # fleets and routers are gone
        config_json = data[name]["config"]
        assert all(_refused(u) for u in [config_json["target"], *config_json["backend_metrics"]])


def test_demo_with_tiny_arguments_prints_the_table_and_exits_0(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = main(
        [
            "demo", "--backends", "2", "--profile", "tiny", "--concurrency", "4",
            "--num-requests", "20", "--speedup", "2", "--think-time", "0,0.05",
            "--out", str(out), "--quiet",
            *SMALL_ARGS,
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "engine hit" in printed and "P99 TTFT ms" in printed
    assert "round_robin" in printed and "kvroute" in printed and str(out) in printed
    assert {"compare.json", "compare_ttft_cdf.png", "compare_bars.png"} <= {
        p.name for p in out.iterdir()
    }
    data = json.loads((out / "compare.json").read_text())
    assert all(_refused(r["config"]["target"]) for r in data.values())


def test_sigterm_during_a_run_tears_the_fleet_down(tmp_path):
    """A compare killed with SIGTERM stops its fleet and router before exiting."""
    import subprocess
    import time

    log_dir = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "kvroute.cli", "compare", "--workload", "ranvier-stress",
            "--backends", "2", "--profile", "tiny", "--routers", "kvroute",
            "--duration", "60", "--out", str(log_dir), "--quiet", *SMALL_ARGS,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    router_log = log_dir / "logs" / "kvroute-router.log"
    while time.monotonic() < deadline and not router_log.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    children = _children(proc.pid)
    assert len(children) == 2  # the sim fleet and the router
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not [pid for pid in children if _alive(pid)]


def test_rate_runs_an_open_loop_and_excludes_concurrency(tmp_path, capsys):
    from kvroute.bench.compare import build_load, build_workload
    from kvroute.bench.compare_cli import config_from_args
    from kvroute.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["compare", "--workload", "b2b", "--routers", "kvroute", "--rate", "2.5",
         "--duration", "30"]
    )  # fmt: skip
    config = config_from_args(args, tmp_path)
    load = build_load(config, build_workload(config))
    assert load.mode == "open" and load.rates == (2.5 * config.speedup,)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["compare", "--workload", "gsp", "--rate", "2", "--concurrency", "4"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
