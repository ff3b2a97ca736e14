"""The ``agentic`` workload: deterministic agent sessions whose contexts grow to a cap."""

from __future__ import annotations

import collections
import itertools
import json

import pytest
from aiohttp import web

from kvroute.bench.fake_backend import make_fake_app, router_like_state
from kvroute.bench.load import LoadConfig, default_load
from kvroute.bench.runner import run_benchmark
from kvroute.bench.spec import RequestSpec, count_tokens
from kvroute.bench.timescale import TimeScaled
from kvroute.bench.workloads import Workload, make_workload
from kvroute.bench.workloads.agentic import Agentic, AgenticParams

SMALL = {  # the default shape, shrunk so a test generates hundreds of sessions quickly
    "harness_tokens": "200,400",
    "repo_tokens": "50,120",
    "task_tokens": "5,20",
    "answer_median_tokens": "8",
    "answer_tokens": "2,40",
    "tool_output_median_tokens": "40",
    "tool_output_tokens": "5,300",
    "max_context_tokens": "1200",
}


def small(seed: int = 0, **extra: str) -> Workload:
    return make_workload("agentic", seed=seed, overrides={**SMALL, **extra})


def sessions(workload: Workload, n: int) -> list[tuple[RequestSpec, ...]]:
    return list(itertools.islice(workload.sessions(), n))


def as_bytes(workload: Workload, n: int) -> bytes:
    return "\n".join(t.to_json() for s in sessions(workload, n) for t in s).encode()


def test_same_seed_same_bytes_other_seed_other_bytes():
    assert as_bytes(small(7), 40) == as_bytes(small(7), 40)
    assert as_bytes(small(7), 40) != as_bytes(small(8), 40)
    # a session is the same on its own as in the stream (the simulator may ask for one)
    w = small(7)
    assert w.session(25) == sessions(small(7), 26)[25]


def test_each_turn_extends_the_previous_prompt_and_the_context_grows():
    for session in sessions(small(3), 60):
        first = session[0]
        assert [m[0] for m in first.messages] == ["system", "user"]
        assert first.think_time_s == 0.0
        assert [t.turn for t in session] == list(range(len(session)))
        assert {(t.session_id, t.prefix_group) for t in session} == {
            (first.session_id, first.session_id)
        }
        for prev, cur in itertools.pairwise(session):
            # the prefix property that makes caching work: the whole previous prompt
            # (ending with the assistant cue) starts the next one
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m[0] for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert cur.messages[len(prev.messages)][1].count(" ") + 1 == prev.max_tokens
            assert cur.prompt_text().startswith(prev.prompt_text())
            assert cur.num_prompt_tokens > prev.num_prompt_tokens
        for turn in session:
            assert count_tokens(turn.prompt_text()) == turn.num_prompt_tokens


def test_harness_prompts_are_shared_and_repositories_are_not():
    got = sessions(small(1), 300)
    harnesses = collections.Counter(s[0].messages[0][1] for s in got)
    assert len(harnesses) == 3
    counts = sorted(harnesses.values(), reverse=True)
    assert counts[0] > 1.5 * counts[2]  # weights 1 : 1/2 : 1/3
    assert all(200 <= count_tokens(h) <= 400 for h in harnesses)
    repos = {s[0].messages[1][1] for s in got}
    assert len(repos) == len(got)  # each session's repository context is its own
    assert len({s[0].session_id for s in got}) == len(got)


def test_default_sizes_match_the_docstring():
    got = sessions(make_workload("agentic"), 120)
    harnesses = {s[0].messages[0][1] for s in got}
    assert len(harnesses) == 3 and all(5000 <= count_tokens(h) <= 10000 for h in harnesses)
    turns = [t for s in got for t in s]
    assert all(t.num_prompt_tokens + t.max_tokens <= 30000 for t in turns)
    assert max(t.num_prompt_tokens for t in turns) > 25000  # sessions do reach the cap
    assert max(map(len, got)) <= 40
    mean_prompt = sum(t.num_prompt_tokens for t in turns) / len(turns)
    assert 16000 < mean_prompt < 22000  # the docstring's 19.2k


def test_the_cap_bounds_every_request_and_ends_sessions():
    cap = int(SMALL["max_context_tokens"])
    got = sessions(small(2, min_turns="100", max_turns="100"), 100)
    # no session can send 100 turns under this cap: each one ends at the cap
    assert all(len(s) < 100 for s in got)
    for s in got:
        assert all(t.num_prompt_tokens + t.max_tokens <= cap for t in s)
        assert s[-1].num_prompt_tokens > cap - 2 * 300  # stopped near it, not early
    # with room to spare, the drawn number of turns is sent
    roomy = sessions(small(2, min_turns="5", max_turns="5", max_context_tokens="30000"), 20)
    assert {len(s) for s in roomy} == {5}


def test_gaps_are_mostly_tool_loop_with_some_human_pauses():
    gaps = [t.think_time_s for s in sessions(small(4), 400) for t in s if t.turn > 0]
    short = [g for g in gaps if 1.0 <= g <= 5.0]
    long = [g for g in gaps if 20.0 <= g <= 120.0]
    assert len(short) + len(long) == len(gaps) > 2000
    assert 0.07 < len(long) / len(gaps) < 0.17  # human_pause_prob 0.12
    assert max(long) > 100 and min(long) < 40  # spread over the range
    none = [t.think_time_s for s in sessions(small(4, human_pause_prob="0"), 50) for t in s]
    assert max(none) <= 5.0


def test_session_header_is_on_every_request_only_when_asked():
    plain = [t for s in sessions(small(5), 20) for t in s]
    assert all(t.headers == () and '"headers"' not in t.to_json() for t in plain)
    tagged = [t for s in sessions(small(5, session_header="x-session-id"), 20) for t in s]
    assert all(t.headers == (("x-session-id", t.session_id),) for t in tagged)
    assert json.loads(tagged[0].to_json())["headers"] == [["x-session-id", "agentic-000000"]]
    # the header changes nothing else
    assert [dataclass_without_headers(t) for t in tagged] == [
        dataclass_without_headers(t) for t in plain
    ]


def dataclass_without_headers(spec: RequestSpec) -> str:
    fields = json.loads(spec.to_json())
    fields.pop("headers", None)
    return json.dumps(fields, sort_keys=True)


def test_spec_without_headers_keeps_its_bytes_and_bad_header_names_are_refused():
    spec = RequestSpec("r-1", "completions", None, "a b", 3, 2, "g")
    assert spec.to_json() == (
        '{"arrival_s":null,"endpoint":"completions","max_tokens":3,"messages":null,'
        '"num_prompt_tokens":2,"prefix_group":"g","prompt":"a b","request_id":"r-1",'
        '"session_id":null,"think_time_s":0.0,"turn":0}'
    )
    for bad in ("", "x:y"):
        with pytest.raises(ValueError, match="header"):
            RequestSpec("r-1", "completions", None, "a b", 3, 2, "g", headers=((bad, "v"),))
    with pytest.raises(ValueError, match="session_header"):
        make_workload("agentic", overrides={"session_header": "x-id:"})


def test_time_scaling_keeps_headers_and_divides_gaps():
    inner = small(6, session_header="x-session-id")
    scaled = sessions(TimeScaled(inner, 4.0), 5)
    for a, b in zip(sessions(inner, 5), scaled, strict=True):
        assert [t.headers for t in a] == [t.headers for t in b]
        assert [t.think_time_s / 4.0 for t in a] == [t.think_time_s for t in b]


def test_make_workload_overrides_and_defaults():
    w = make_workload(
        "agentic",
        seed=3,
        overrides={"num_harnesses": "5", "human_pause_s": "30,60", "session_header": "x-a"},
    )
    assert isinstance(w, Agentic)
    assert w.params == AgenticParams(
        num_harnesses=5, human_pause_s=(30.0, 60.0), session_header="x-a"
    )
    assert w.describe()["params"]["num_harnesses"] == 5
    load = default_load(make_workload("agentic"))
    assert (load.mode, load.num_users, load.num_requests) == ("closed", 128, 2000)
    with pytest.raises(ValueError, match="max_context_tokens"):
        make_workload("agentic", overrides={"max_context_tokens": "8000"})
    with pytest.raises(ValueError, match="max_turns"):
        make_workload("agentic", overrides={"min_turns": "9", "max_turns": "3"})
    with pytest.raises(ValueError, match="human_pause_prob"):
        make_workload("agentic", overrides={"human_pause_prob": "1.5"})


async def test_load_generator_sends_the_session_header():
    state, seen = router_like_state(), []

    @web.middleware
    async def record(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if request.method == "POST":
            seen.append(request.headers.get("x-session-id"))
        return await handler(request)

    app = make_fake_app(state)
    app.middlewares.append(record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        workload = small(9, session_header="x-session-id", tool_gap_s="0,0", human_pause_prob="0")
        load = LoadConfig(mode="closed", num_users=3, num_requests=20)
        bench = await run_benchmark(f"http://{host}:{port}", workload, load)
    finally:
        await runner.cleanup()
    assert bench["completed"] == 20 and len(seen) == 20
    assert collections.Counter(seen) == collections.Counter(r.session_id for r in bench.records)
