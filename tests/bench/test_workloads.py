"""Workloads: deterministic per seed, and shaped like the generators they copy."""

from __future__ import annotations

import collections
import itertools

import pytest

from kvroute.bench.spec import RequestSpec, count_tokens
from kvroute.bench.workloads import SYNTHETIC, make_workload

SYNTHETIC_NAMES = sorted(SYNTHETIC)
SMALL = {  # shrink the big ones so the suite stays fast
    "b2b": {"context_tokens": "600", "question_tokens": "120", "num_groups": "20"},
    "gsp": {"system_prompt_tokens": "256"},
}


def take(name: str, seed: int, n: int, **overrides: str) -> list[RequestSpec]:
    ov = {**SMALL.get(name, {}), **overrides}
    return list(itertools.islice(make_workload(name, seed=seed, overrides=ov).requests(), n))


def as_bytes(specs: list[RequestSpec]) -> bytes:
    return "\n".join(s.to_json() for s in specs).encode()


@pytest.mark.parametrize("name", SYNTHETIC_NAMES)
def test_same_seed_same_bytes_other_seed_other_bytes(name):
    a, b, c = take(name, 7, 60), take(name, 7, 60), take(name, 8, 60)
    assert as_bytes(a) == as_bytes(b)
    assert as_bytes(a) != as_bytes(c)
    assert len({s.request_id for s in a}) == len(a)


@pytest.mark.parametrize("name", SYNTHETIC_NAMES)
def test_num_prompt_tokens_is_the_tokenizer_count_of_the_engine_prompt(name):
    for spec in take(name, 3, 25):
        assert count_tokens(spec.prompt_text()) == spec.num_prompt_tokens


def test_unknown_workload_and_bad_override_name_the_problem():
    with pytest.raises(ValueError, match="gsp"):
        make_workload("nope")
    with pytest.raises(ValueError, match="num_groupz"):
        make_workload("gsp", overrides={"num_groupz": "3"})
    with pytest.raises(ValueError, match="must be > 0"):
        make_workload("gsp", overrides={"num_groups": "0"})


def test_ranvier_stress_mix_over_2000_draws():
    specs = take("ranvier-stress", 1, 2000)
    kinds = collections.Counter(s.prefix_group.split("-")[0] for s in specs)
    large = [s for s in specs if s.prefix_group.startswith("large")]
    xlarge = [s for s in large if s.messages[0][1] and s.num_prompt_tokens > 4000]
    shares = {
        "short": kinds["short"] / 2000,
        "medium": (kinds["medium"] + kinds["unique"]) / 2000,
        "large": (len(large) - len(xlarge)) / 2000,
        "xlarge": len(xlarge) / 2000,
    }
    for bucket, want in {"short": 0.1, "medium": 0.2, "large": 0.3, "xlarge": 0.4}.items():
        assert shares[bucket] == pytest.approx(want, abs=0.03), bucket
    medium_shared = kinds["medium"] / (kinds["medium"] + kinds["unique"])
    assert medium_shared == pytest.approx(0.9, abs=0.05)
    # a handful of byte-identical full prompts carry ~70 % of the traffic
    distinct = collections.Counter(s.prompt_text() for s in large)
    assert len(distinct) == 5


def test_ranvier_stress_prefix_shapes():
    specs = take("ranvier-stress", 1, 400)
    systems = {s.messages[0][1] for s in specs if s.prefix_group.startswith("large")}
    assert sorted(t.split("]")[0] for t in systems) == [f"[Context ID: {i}" for i in range(5)]
    sizes = sorted(count_tokens(t) for t in systems)
    assert sizes == [2000, 3500, 5000, 6500, 8000]
    assert all(s.max_tokens == 100 and s.endpoint == "chat" for s in specs)
    short = [s for s in specs if s.prefix_group.startswith("short")]
    assert all(len(s.messages) == 1 and s.messages[0][0] == "user" for s in short)
    assert len({s.prefix_group for s in short}) == 5


def test_gsp_first_round_is_64_groups_of_16_with_exact_sizes():
    specs = take("gsp", 0, 1024, system_prompt_tokens="2048")
    groups = collections.Counter(s.prefix_group for s in specs)
    assert len(groups) == 64 and set(groups.values()) == {16}
    assert {s.num_prompt_tokens for s in specs} == {2048 + 128}
    assert {s.max_tokens for s in specs} == {256}
    by_group = collections.defaultdict(set)
    for s in specs:
        by_group[s.prefix_group].add(s.prompt[: s.prompt.index(" ", 8000)])
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({s.prompt for s in specs}) == 1024  # questions are unique


def test_prefix_repetition_balanced_prefixes_unique_suffixes():
    specs = take("prefix-repetition", 0, 100)
    assert set(collections.Counter(s.prefix_group for s in specs).values()) == {10}
    assert {s.num_prompt_tokens for s in specs} == {512}
    assert len({s.prompt for s in specs}) == 100
    assert {s.max_tokens for s in specs} == {128}


def test_b2b_defaults_and_fixed_questions_per_user():
    w = make_workload("b2b")
    assert (w.params.num_groups, w.params.context_tokens, w.params.question_tokens) == (
        150,
        6000,
        1200,
    )
    assert w.defaults.rates[0] == 3.0 and w.defaults.rates[-1] == 60.0
    specs = take("b2b", 0, 300)
    # at most groups x users distinct prompts: questions are fixed per user
    assert len({s.prompt for s in specs}) <= 20 * 5
    assert {s.num_prompt_tokens for s in specs} == {720}


def test_zipf_hot_popularity_is_skewed():
    specs = take("zipf-hot", 0, 2000)
    counts = collections.Counter(s.prefix_group for s in specs)
    top, second, tenth = counts["zipf-0"], counts["zipf-1"], counts["zipf-9"]
    assert top > second > tenth
    assert top / 2000 == pytest.approx(1 / sum(1 / k**1.1 for k in range(1, 257)), abs=0.03)
    assert top / max(1, tenth) > 5  # 10**1.1 = 12.6 in expectation


def test_multiturn_turns_append_history():
    w = make_workload("multiturn", seed=2)
    sessions = list(itertools.islice(w.sessions(), 30))
    assert all(3 <= len(s) <= 10 for s in sessions)
    systems = {s[0].messages[0][1] for s in sessions}
    assert 1 < len(systems) <= 4
    for session in sessions:
        assert [t.turn for t in session] == list(range(len(session)))
        assert len({t.session_id for t in session}) == 1
        assert session[0].think_time_s == 0.0
        for prev, cur in itertools.pairwise(session):
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert cur.messages[len(prev.messages)][0] == "assistant"
            assert cur.messages[-1][0] == "user"
            assert cur.prompt_text().startswith(prev.prompt_text()[: -len("<|assistant|>\n")])
            assert 1.0 <= cur.think_time_s <= 5.0
            assert cur.num_prompt_tokens > prev.num_prompt_tokens
