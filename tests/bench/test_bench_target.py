"""``kvroute bench`` asks the target before the load: a dead port, a non-URL, a ``/v1``
suffix or a model the target does not serve is one line naming the target and the
cause (exit 2), not a run of thousands of failures; a run with failures says why."""

from __future__ import annotations

import socket
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvroute.bench.metrics import RequestRecord
from kvroute.bench.report import format_failures
from kvroute.bench.runner import TargetError, check_backend_metrics, check_target
from kvroute.cli import main

BENCH = ["bench", "--workload", "gsp", "--duration", "2", "--no-plots", "--quiet"]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_dead_target_is_refused_naming_it(session: aiohttp.ClientSession) -> None:
    target = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(TargetError, match=rf"--target {target}: cannot connect \("):
        await check_target(session, target)


async def test_a_v1_suffix_gets_a_hint(fake, session: aiohttp.ClientSession) -> None:
    url, _state = fake
    with pytest.raises(TargetError) as info:
        await check_target(session, url + "/v1/")
    message = str(info.value)
    assert f"GET {url}/v1/v1/models answered 404" in message
    assert message.endswith("drop the /v1 from --target (bench adds /v1/... itself)")


async def test_a_model_the_target_does_not_serve_is_refused(
    fake, session: aiohttp.ClientSession
) -> None:
    url, state = fake
    await check_target(session, url, state.model)
    await check_target(session, url)
    with pytest.raises(TargetError) as info:
        await check_target(session, url, "nope")
    assert str(info.value) == f"--model 'nope' is not served by {url}; it serves: {state.model}"


async def test_a_target_without_a_model_list_passes_when_its_health_answers(
    session: aiohttp.ClientSession,
) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    async with TestServer(app, host="127.0.0.1") as server:
        target = str(server.make_url("")).rstrip("/")
        await check_target(session, target, "any")  # the model cannot be checked


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("notaurl", [], "--target 'notaurl' is not an http(s) URL"),
        ("http://127.0.0.1:{port}", [], "--target http://127.0.0.1:{port}: cannot connect ("),
        ("http://127.0.0.1:{port}", ["--timeout", "0"], "--timeout must be > 0"),
    ],
)
def test_bench_refuses_before_any_load_with_exit_2(
    target: str, extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = closed_port()
    out = tmp_path / "out"
    argv = [*BENCH, "--target", target.format(port=port), *extra, "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvroute bench: {message.format(port=port)}")
    assert len(err.splitlines()) == 1 and not out.exists()


def test_an_out_that_is_a_file_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "ok.jsonl"
    a_file.write_text("")
    argv = [*BENCH, "--target", f"http://127.0.0.1:{closed_port()}", "--out", str(a_file)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"kvroute bench: --out {a_file}: is a file, not a folder; give a folder to write into\n"
    )
    assert main([*BENCH, "--target", "http://127.0.0.1:9", "--out", str(a_file / "x")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def record(error: str | None) -> RequestRecord:
    return RequestRecord("r", "g", None, 0, 0.0, error is None, None, (), None, 1, 0, None, None,
                         error=error)  # fmt: skip


def test_format_failures_counts_the_most_common_reasons_first() -> None:
    records = [record("HTTP 503: busy")] * 3 + [record("timeout after 5 s")] * 5
    records += [record(None), record("HTTP 500:\n  multi\nline"), record("x"), record("y")]
    assert format_failures(records, top=2).splitlines() == [
        "Failed requests by reason (11 in all, warm-up included):",
        "       5 x timeout after 5 s",
        "       3 x HTTP 503: busy",
        "           and 3 other reasons",
    ]
    assert format_failures([record(None)]) == ""


def test_a_run_with_failures_prints_why(fake_in_thread, capsys) -> None:
    url, state = fake_in_thread
    state.fail_status = 500
    argv = ["bench", "--target", url, "--workload", "gsp", "--num-requests", "4",
            "--concurrency", "2", "--quiet"]  # fmt: skip
    assert main(argv) == 1
    printed = capsys.readouterr().out
    assert "Failed requests by reason (4 in all, warm-up included):" in printed
    assert "       4 x HTTP 500: " in printed


async def test_backend_metrics_without_engine_counters_are_refused(
    fake, session: aiohttp.ClientSession
) -> None:
    """A run whose --backend-metrics give no counters ended with "hit rate n/a" and no
    word of why (a router's address, a dead port)."""
    url, state = fake
    await check_backend_metrics(session, [url])
    dead = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(TargetError, match=rf"--backend-metrics {dead}: {dead}/metrics gives no"):
        await check_backend_metrics(session, [url, dead])
    state.metrics_text = "# HELP kvroute_requests_total x\n# TYPE kvroute_requests_total counter\n"
    with pytest.raises(TargetError, match="not the router's"):
        await check_backend_metrics(session, [url])
