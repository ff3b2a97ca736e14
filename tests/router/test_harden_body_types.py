"""A request body read as an attacker would write it: odd types get a 400, fields the
router does not read travel untouched (issue 9).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core import keys
from kvroute.router.errors import BadRequest
from kvroute.router.request import MAX_TOKENS_CAP, parse_completion, parse_completion_body
from tests.router.conftest import Harness, assert_no_load
from tests.router.harden_request_helpers import (
    OK_BODY,
    assert_bad_request,
    assert_still_serves,
)

# -- the rest of the body, read as an attacker would -------------------------------------

ODD_BODIES = [
    ("role is a list", "/v1/chat/completions", {"messages": [{"role": [], "content": "x"}]}),
    ("role is an object", "/v1/chat/completions", {"messages": [{"role": {}, "content": "x"}]}),
    ("token ids are booleans", "/v1/completions", {"prompt": [True, False]}),
    ("negative token id", "/v1/completions", {"prompt": [1, -1]}),
    ("token id beyond 2**31", "/v1/completions", {"prompt": [1, 2**31]}),
    ("huge token id", "/v1/completions", {"prompt": [10**300]}),
    ("batch of id lists, one nested", "/v1/completions", {"prompt": [[1, 2], [[3]]]}),
    ("batch of id lists, one empty", "/v1/completions", {"prompt": [[1, 2], []]}),
    ("batch mixing strings and ids", "/v1/completions", {"prompt": ["a", 5]}),
    ("max_tokens above the cap", "/v1/completions", {"prompt": "x", "max_tokens": 2**24 + 1}),
    ("max_tokens a float", "/v1/completions", {"prompt": "x", "max_tokens": 1.5}),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "9"}),
]


@pytest.mark.parametrize(
    ("path", "body"), [c[1:] for c in ODD_BODIES], ids=[c[0] for c in ODD_BODIES]
)
async def test_odd_types_get_a_400(harness: Harness, path: str, body: dict[str, Any]) -> None:
    b = await harness.backend("a")
    client = await harness.router([b.url])
    resp = await client.post(path, data=json.dumps({"model": "m1", **body}))
    await assert_bad_request(resp, "")
    assert not b.state.requests
    await assert_still_serves(client)


PASSED_THROUGH = [
    ("stream_options a string", {"stream_options": "yes"}),
    ("user a list", {"user": ["a"]}),
    ("cache_salt a number", {"cache_salt": 5}),
    ("cache_salt a long string", {"cache_salt": "s" * 100_000}),
    ("n huge", {"n": 10**300}),
]


@pytest.mark.parametrize(
    "extra", [c[1] for c in PASSED_THROUGH], ids=[c[0] for c in PASSED_THROUGH]
)
async def test_fields_the_router_does_not_read_reach_the_engine_untouched(
    harness: Harness, extra: dict[str, Any]
) -> None:
    """The router reads none of these: they travel as sent and the engine judges them."""
    b = await harness.backend("a")
    client = await harness.router([b.url])
    raw = json.dumps({**OK_BODY, **extra}).encode()
    resp = await client.post("/v1/completions", data=raw)
    assert resp.status == 200
    assert b.state.requests[-1]["body"] == raw
    assert_no_load(harness.state(client))


def test_valid_prompt_shapes_still_route_as_before() -> None:
    """A batch routes on its first prompt; ids at the ends of the range are ids."""
    for prompt, text, ids in (
        ("a", "a", None),
        (["a", "b"], "a", None),
        ([0, 2**31 - 1], None, (0, 2**31 - 1)),
        ([[5, 6], [7]], None, (5, 6)),
    ):
        parsed = parse_completion(json.dumps({"prompt": prompt}).encode(), chat=False)
        assert (parsed.prompt.text, parsed.prompt.token_ids) == (text, ids)


def test_token_id_count_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body limit raised far enough would let a prompt hold more ids than any context."""
    monkeypatch.setattr(keys, "MAX_PROMPT_TOKEN_IDS", 4)
    parse_completion(b'{"prompt": [1, 2, 3, 4]}', chat=False)
    with pytest.raises(BadRequest, match="at most 4 token ids"):
        parse_completion(b'{"prompt": [1, 2, 3, 4, 5]}', chat=False)
    with pytest.raises(BadRequest, match="at most 4 token ids"):
        parse_completion(b'{"prompt": [[1], [1, 2, 3, 4, 5]]}', chat=False)


async def test_a_token_prompt_longer_than_the_context_is_refused(harness: Harness) -> None:
    b = await harness.backend("a")
    b.state.max_model_len = 8
    client = await harness.router([b.url])
    backends = harness.state(client).backends
    fits = parse_completion(json.dumps({"prompt": list(range(7))}).encode(), chat=False)
    backends.check_context("m1", fits)
    too_long = parse_completion(json.dumps({"prompt": list(range(8))}).encode(), chat=False)
    with pytest.raises(BadRequest, match="8 token ids"):
        backends.check_context("m1", too_long)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([10**308, 10**400, 2**31, -1, 0])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=24,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "tool", "bot"]) | values},
        optional={"content": values, "tool_calls": values},
    ),
    max_size=4,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=8) | values,
        "prompt": values,
        "messages": messages | values,
        "tools": values,
        "max_tokens": values,
        "max_completion_tokens": values,
        "stream": values,
        "cache_salt": values,
    },
)


@settings(max_examples=400, deadline=None)
@given(body=bodies, chat=st.booleans())
def test_any_body_parses_or_is_a_bad_request(body: dict[str, Any], chat: bool) -> None:
    """Whatever JSON a client sends, parsing answers a ParsedRequest or a 400 (no other
    exception, which the app would turn into a 500)."""
    try:
        parsed, _ = parse_completion_body(json.dumps(body).encode(), chat=chat)
    except BadRequest:
        return
    assert 1 <= parsed.max_tokens <= MAX_TOKENS_CAP
    assert parsed.model is None or isinstance(parsed.model, str)
    ids = parsed.prompt.token_ids
    assert ids is None or all(0 <= t <= keys.MAX_TOKEN_ID for t in ids)


async def test_a_text_prompt_beyond_the_context_is_sent_but_not_recorded(harness: Harness) -> None:
    # The router cannot count a text prompt's tokens exactly, so it forwards it and lets
    # the engine refuse it; its estimate says the engine will, so none of its blocks
    # enter the cache model, where they would push out what the engine really holds.
    b = await harness.backend("a")
    b.state.max_model_len = 64
    client = await harness.router([b.url])
    index = harness.state(client).fleet.index
    resp = await client.post(
        "/v1/completions", data=json.dumps({"model": "m1", "prompt": "word " * 4000})
    )
    assert b.state.requests  # forwarded: the engine decides
    await resp.read()
    assert index.num_blocks(b.url) == 0
    resp = await client.post("/v1/completions", data=json.dumps({"model": "m1", "prompt": "hi"}))
    await resp.read()
    assert_no_load(harness.state(client))


@pytest.mark.parametrize(
    "raw", [b'{"prompt": "\\ud800"}', b'{"model": "m1", "prompt": ["a", "\\uDBFF"]}']
)
def test_a_lone_surrogate_escape_is_named_not_called_a_truncated_body(raw: bytes) -> None:
    with pytest.raises(BadRequest, match="high surrogate") as info:
        parse_completion(raw, chat=False)
    assert "truncated" not in str(info.value)


def test_a_really_truncated_body_still_says_so() -> None:
    with pytest.raises(BadRequest, match="truncated"):
        parse_completion(b'{"prompt": "\\ud800\\udc00', chat=False)


def test_the_decode_cap_is_read_as_vllm_reads_it() -> None:
    chat = b'{"messages": [{"role": "user", "content": "x"}], '
    both = parse_completion(chat + b'"max_tokens": 3, "max_completion_tokens": 5}', chat=True)
    assert both.max_tokens == 5
    # a completion has no max_completion_tokens: vLLM ignores it, so does the router
    plain = parse_completion(b'{"prompt": "x", "max_tokens": 2, "max_completion_tokens": 0}',
                             chat=False)  # fmt: skip
    assert plain.max_tokens == 2
