"""The real-vLLM run's pure parts, tested in the default run (no vLLM needed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvroute.bench.real_vllm.engines import kv_endpoints
from kvroute.bench.real_vllm.events import EventTally, apply_event
from kvroute.bench.real_vllm.results import EngineRow, ModeResult, format_table, verdict
from kvroute.bench.real_vllm.workload import Workload, ceiling_hit_rate
from kvroute.common.chat import render_chat
from kvroute.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    encode_batch,
)

MAKE_MODEL = Path(__file__).resolve().parents[2] / "scripts" / "real_vllm" / "make_model.py"


def _make_model() -> ModuleType:
    """make_model.py runs under the vLLM venv's Python, so it stays a script: load it by
    path (it imports only the standard library at the top)."""
    spec = importlib.util.spec_from_file_location("make_model", MAKE_MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_model = _make_model()
CHAT_TEMPLATE, llama_config, tokenizer_config = (
    make_model.CHAT_TEMPLATE,
    make_model.llama_config,
    make_model.tokenizer_config,
)


def test_tally_follows_stored_removed_and_cleared() -> None:
    t = EventTally()
    apply_event(t, BlockStored([1, 2, 3], None, list(range(384)), 128))
    apply_event(t, BlockRemoved([2]))
    assert t.live_blocks == {1, 3}
    assert (t.stored, t.removed, t.block_size) == (3, 1, 128)
    apply_event(t, AllBlocksCleared())
    assert t.live_blocks == set()
    assert t.cleared == 1


@pytest.mark.parametrize("form", ["array", "map"])
def test_tally_reads_both_wire_forms(form: str) -> None:
    payload = encode_batch(1.0, [BlockStored([7, 8], None, [0] * 256, 128)], form=form)
    t = EventTally()
    for ev in decode_batch(payload)[1]:
        apply_event(t, ev)
    assert t.live_blocks == {7, 8}


def test_kv_endpoints_bind_what_vllm_binds(tmp_path: Path) -> None:
    bind, connect = kv_endpoints(0, "ipc", tmp_path)
    assert bind == connect and bind.startswith("ipc://")
    bind, connect = kv_endpoints(1, "tcp", tmp_path)
    # vLLM binds only wildcard tcp endpoints; a host address makes it connect instead.
    assert bind.startswith("tcp://*:")
    assert connect == "tcp://127.0.0.1:" + bind.rsplit(":", 1)[1]
    with pytest.raises(ValueError, match="kv_transport"):
        kv_endpoints(0, "udp", tmp_path)


def test_chat_template_renders_what_the_router_hashes() -> None:
    jinja2 = pytest.importorskip("jinja2")
    # Hugging Face renders chat templates with these settings.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    messages = [
        {"role": "system", "content": "You help.\nBe brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ]
    text = env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert text == render_chat(messages)


def test_model_config_is_a_small_gqa_llama() -> None:
    cfg = llama_config(256, 2, 8192)
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["hidden_size"] == 256
    assert tokenizer_config()["chat_template"] == CHAT_TEMPLATE


def test_workload_args_pin_the_bench_run() -> None:
    wl = Workload(4, 1500, 64, 16, 80, 4, 0)
    args = wl.bench_args()
    assert args[:2] == ["--workload", "zipf-hot"]
    assert "num_prefixes=4" in args and "prefix_tokens=1500" in args
    assert args[args.index("--num-requests") + 1] == "80"
    assert "--ignore-eos" in args and "--no-stream" not in args
    assert "--no-stream" in wl.bench_args(stream=False)


def test_the_ceiling_counts_only_blocks_an_earlier_prompt_computed() -> None:
    a = list(range(100))  # 3 full blocks of 32, 4 tokens more
    b = [*a[:64], *range(500, 540)]  # shares 2 blocks with a
    # a misses all; a again hits 3 blocks; b hits 2 (its 3rd block differs)
    assert ceiling_hit_rate([a, a, b], 32) == pytest.approx((96 + 64) / (100 + 100 + 104))
    # a prompt of exactly 2 blocks repeated: vLLM recomputes the last token, so 1 block
    c = list(range(1000, 1064))
    assert ceiling_hit_rate([c, c], 32) == pytest.approx(32 / 128)


def test_the_workload_sends_the_issue_s_requests() -> None:
    msgs = list(Workload(6, 50, 8, 4, 20, 4, 0).messages())
    assert len(msgs) == 20
    systems = {m[0]["content"] for m in msgs}
    assert 2 <= len(systems) <= 6 and all(m[-1]["role"] == "user" for m in msgs)


def test_table_shows_each_mode_and_engine() -> None:
    row = EngineRow("http://127.0.0.1:1", 900, 1000, 12, 12, 0.9, 20, 8)
    ok = ModeResult("approx", "ok", False, 2, 80, 0, 0.9, 0.9, 12.5, True, [row])
    todo = ModeResult("exact", "TODO: no --mode")
    table = format_table([ok, todo])
    assert "90.0 %" in table and "TODO: no --mode" in table
    assert "900/1000" in table and "whole" in table


def test_the_verdict_applies_issue_10_s_bar_per_run_and_client_kind() -> None:
    def res(mode: str, hr: float, stream: bool = True) -> ModeResult:
        return ModeResult(mode, "ok", stream, 1, 72, 0, hr)

    good = [res("round_robin", 0.47), res("approx", 0.80), res("exact", 0.84)]
    text, ok = verdict(good, 0.88)
    assert ok and "ok" in text
    low = [*good, res("round_robin", 0.47, False), res("approx", 0.74, False)]
    text, ok = verdict(low, 0.88)  # 0.74 < 0.85 x 0.88
    assert not ok and "BELOW" in text
