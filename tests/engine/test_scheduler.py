"""Scheduler stories: batching, chunked prefill, the max_num_seqs cap, FCFS admission and
preemption when the cache runs out of blocks."""

from __future__ import annotations

from kvroute.engine import Engine

from .helpers import make_profile, run_to_completion, tokens


def test_requests_batch_into_one_prefill_then_decode_together() -> None:
    engine = Engine(make_profile())
    for i in range(3):
        engine.add_request(f"r{i}", tokens(1000 * i, 20), 3)
    first = engine.step()
    assert first.num_prefill_tokens == 60 and first.num_decode_seqs == 0
    assert [(o.request_id, o.is_first) for o in first.outputs] == [
        ("r0", True),
        ("r1", True),
        ("r2", True),
    ]
    second = engine.step()
    assert second.num_prefill_tokens == 0 and second.num_decode_seqs == 3
    assert len(second.outputs) == 3 and not any(o.is_first for o in second.outputs)
    third = engine.step()
    assert [o.finish_reason for o in third.outputs] == ["length"] * 3
    assert not engine.has_unfinished_requests()
    idle = engine.step()
    assert idle.duration_s == 0.0 and idle.outputs == []


def test_long_prompt_is_chunked_across_steps() -> None:
    engine = Engine(make_profile(max_num_batched_tokens=64))
    engine.add_request("long", tokens(0, 150), 2)
    chunks = []
    for _ in range(3):
        result = engine.step()
        chunks.append((result.num_prefill_tokens, [o.is_first for o in result.outputs]))
    assert chunks == [(64, []), (64, []), (22, [True])]


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget() -> None:
    engine = Engine(make_profile(max_num_batched_tokens=64))
    engine.add_request("short", tokens(0, 10), 5)
    engine.step()  # short prefilled, first token out
    engine.add_request("long", tokens(500, 150), 1)
    result = engine.step()
    assert result.num_decode_seqs == 1 and result.num_prefill_tokens == 63
    assert [o.request_id for o in result.outputs] == ["short"]


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = Engine(make_profile(max_num_seqs=2))
    for i in range(3):
        engine.add_request(f"r{i}", tokens(1000 * i, 8), 2)
    engine.step()
    assert (engine.stats.num_running, engine.stats.num_waiting) == (2, 1)
    finished = engine.step()
    assert [o.request_id for o in finished.outputs if o.finish_reason] == ["r0", "r1"]
    assert engine.stats.num_waiting == 1  # admitted next step, when a slot is free
    third = engine.step()
    assert [(o.request_id, o.is_first) for o in third.outputs] == [("r2", True)]


def test_waiting_requests_are_admitted_first_come_first_served() -> None:
    engine = Engine(make_profile(max_num_seqs=1))
    for name in ("c", "a", "b"):
        engine.add_request(name, tokens(ord(name) * 100, 5), 1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step().outputs]
    assert order == ["c", "a", "b"]


def test_head_of_line_request_blocks_smaller_ones_when_out_of_blocks() -> None:
    profile = make_profile(kv_capacity_tokens=128, max_model_len=128)  # 8 blocks
    engine = Engine(profile)
    engine.add_request("big", tokens(0, 100), 20)  # 7 prompt blocks
    engine.step()
    engine.add_request("next", tokens(500, 40), 1)  # needs 3 blocks: only 1 free
    engine.add_request("small", tokens(900, 5), 1)  # would fit, but FCFS waits
    result = engine.step()
    assert [o.request_id for o in result.outputs] == ["big"]
    assert engine.stats.num_waiting == 2


def test_newest_running_request_is_preempted_and_finishes_later() -> None:
    profile = make_profile(kv_capacity_tokens=128, max_model_len=128)  # 8 blocks of 16
    engine = Engine(profile)
    engine.add_request("old", tokens(0, 48), 64)  # 112 tokens = 7 blocks at the end
    engine.add_request("new", tokens(500, 48), 64)
    steps_with_token: dict[str, list[int]] = {"old": [], "new": []}
    finished: list[str] = []
    for step in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            steps_with_token[out.request_id].append(step)
            if out.finish_reason == "length":
                finished.append(out.request_id)
        engine.check_invariants()
    stats = engine.stats
    assert stats.num_preemptions >= 1
    assert finished == ["old", "new"]
    # The oldest request is never the victim: one token in each of 64 consecutive steps.
    assert steps_with_token["old"] == list(range(64))
    assert len(steps_with_token["new"]) == 64
    assert stats.prefix_cache_queries == 96  # first lookups only, as vLLM exports
    assert stats.preempted_prefix_cache_queries >= 48  # the victim looked up again
    assert stats.kv_cache_usage == 0.0


def test_preempted_request_resumes_its_output_where_it_stopped() -> None:
    profile = make_profile(kv_capacity_tokens=128, max_model_len=128)
    seen: list[tuple[str, int]] = []

    def next_token(request_id: str, index: int) -> int:
        seen.append((request_id, index))
        return 100 + index

    engine = Engine(profile, next_token=next_token)
    engine.add_request("old", tokens(0, 48), 64)
    engine.add_request("new", tokens(500, 48), 64)
    _, outputs = run_to_completion(engine)
    assert [o.token_id for o in outputs["new"]] == [100 + i for i in range(64)]
    assert sorted(i for r, i in seen if r == "new") == list(range(64))  # none resampled
