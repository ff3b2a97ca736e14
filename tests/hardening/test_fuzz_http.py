"""Fuzzing the router's HTTP surface: what a client sends must never break it.

A real router (``make_app`` behind ``start_listeners``, as ``kvroute serve`` runs it, on a
loopback port) sits in front of a
simulated engine (its ``max_model_len`` cut to 1024 so no valid answer runs long); both
run on an event loop in a thread of their own, so each hypothesis example is a plain
blocking request from the test thread, over a real socket. For every example: no 5xx
(only 4xx or the backend's answer), every error body is an OpenAI error object (or, for
an answer the backend itself gave, vLLM's), no error logged by the router, and its load
back to zero. After each test: /health still answers 200.

Bounded: about 500 examples in all, each a loopback request, under a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.bench.hardening import is_openai_error
from kvroute.router.app import make_app
from kvroute.router.config import BackendConfig, HealthConfig, LimitConfig, RouterConfig
from kvroute.router.listener import Listeners, start_listeners
from kvroute.router.state import STATE, RouterState
from kvroute.sim.profiles import get_profile
from kvroute.sim.server import SimFleet, start_fleet

MODEL = "fuzz-model"
MAX_BODY = 65_536
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # CI sees the same examples every run; a failure reproduces
    database=None,
)


class LiveRouter:
    """A router and a simulated engine on a loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0
        self._fleet: SimFleet | None = None
        self._listeners: Listeners | None = None
        self.errors: list[logging.LogRecord] = []

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def start(self) -> LiveRouter:
        self._thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        profile = dataclasses.replace(get_profile("instant"), max_model_len=1024)
        self._fleet = await start_fleet(1, profile=profile, model_name=MODEL)
        config = RouterConfig(
            backends=(BackendConfig(url=self._fleet.urls[0]),),
            policy="prefix",
            port=0,
            health=HealthConfig(interval_s=3600, scrape_interval_s=0),
            limits=LimitConfig(max_body_bytes=MAX_BODY),
        )
        self._listeners = await start_listeners(make_app(config), config)
        self.port = self._listeners.api[1]

    @property
    def state(self) -> RouterState:
        assert self._listeners is not None, "started"
        return self._listeners.runner.app[STATE]

    def close(self) -> None:
        async def stop() -> None:
            if self._listeners is not None:
                await self._listeners.runner.cleanup()
            if self._fleet is not None:
                await self._fleet.close()

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    # ---- client side (test thread) ----------------------------------------------------

    def request(
        self, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body: bytes, **headers: str) -> tuple[int, dict, bytes]:
        return self.request("POST", path, body, {"Content-Type": "application/json", **headers})

    def raw(self, data: bytes, *, half_close: bool = True) -> bytes:
        """Send raw bytes on a fresh connection; whatever comes back before it closes."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            chunks = []
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            return b"".join(chunks)

    # ---- checks -----------------------------------------------------------------------

    def load(self) -> tuple[int, int, int]:
        async def read() -> tuple[int, int, int]:
            states = self.state.fleet.backend_states()
            return (
                self.state.num_in_flight,
                sum(s.in_flight_requests for s in states),
                sum(s.in_flight_tokens for s in states),
            )

        return self.call(read())

    def assert_settled(self, timeout_s: float = 5.0) -> None:
        """Load back to zero (polled: a cut stream's handler may still be unwinding)."""
        deadline = time.monotonic() + timeout_s
        while (load := self.load()) != (0, 0, 0):
            assert time.monotonic() < deadline, f"load left in the router: {load}"
            time.sleep(0.01)
        messages = [r.getMessage() for r in self.errors]
        assert not messages, f"router logged {len(messages)} errors: {messages[:3]}"


class _Errors(logging.Handler):
    def __init__(self, sink: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveRouter]:
    router = LiveRouter().start()
    handler = _Errors(router.errors)
    logger = logging.getLogger("kvroute")
    logger.addHandler(handler)
    try:
        yield router
    finally:
        logger.removeHandler(handler)
        router.close()


@pytest.fixture
def router(live: LiveRouter) -> Iterator[LiveRouter]:
    """The shared router; after each test it must still be healthy and hold nothing."""
    live.errors.clear()
    yield live
    status, _, body = live.request("GET", "/health")
    assert status == 200, body
    live.assert_settled()


def is_vllm_error(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("object") == "error" and "message" in data


def check_answer(router: LiveRouter, status: int, headers: dict[str, str], body: bytes) -> None:
    """The contract for any client input (module doc)."""
    assert status < 500, f"{status} for a client's request: {body[:500]!r}"
    if status >= 400:
        proxied = "x-kvroute-backend" in headers
        ok = is_openai_error(body) or (proxied and is_vllm_error(body))
        assert ok, f"{status} error body is not an OpenAI error: {body[:300]!r}"
    router.assert_settled()


# ---- strategies ---------------------------------------------------------------------

odd_text = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40
) | st.sampled_from(["", "\x00", "\u202e\u200b", "𝕂𝕍", "\ufeff", "a" * 300, "\\u0000", "%s%n"])
huge_ints = st.sampled_from([2**31, 2**63, 2**64, -(2**63), 10**30, 10**308, -1, 0])
numbers = st.integers() | huge_ints | st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | numbers | odd_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=12,
)


words = st.text(st.sampled_from("abc xyz 123\n\t"), min_size=1, max_size=60)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": words | odd_text}
)
OPTIONAL_FIELDS = {
    "max_tokens": st.integers(1, 64),
    "max_completion_tokens": st.integers(1, 64),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "n": st.just(1),
    "seed": st.integers(0, 2**32),
    "cache_salt": words,
    "user": odd_text,
}


@st.composite
def near_valid(draw: st.DrawFn, chat: bool) -> dict[str, Any]:
    """A valid body with 0-2 of its fields (or a message's) replaced by anything: about a
    third reach the engine and stream or answer, the rest probe one bad field at a time."""
    body: dict[str, Any] = {"model": MODEL}
    if chat:
        body["messages"] = draw(st.lists(message, min_size=1, max_size=4))
    else:
        body["prompt"] = draw(words | st.lists(st.integers(0, 2000), min_size=1, max_size=30))
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(OPTIONAL_FIELDS[name])
    wrong = st.one_of(json_values, huge_ints, st.sampled_from(["other-model", ""]))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):
        messages = body.get("messages")
        if chat and isinstance(messages, list) and messages and draw(st.booleans()):
            msg = draw(st.sampled_from(messages))
            if not isinstance(msg, dict):
                continue
            msg[draw(st.sampled_from(["role", "content", "name", "tool_calls"]))] = draw(wrong)
        else:
            keys = sorted({*body, *OPTIONAL_FIELDS})
            body[draw(st.sampled_from(keys))] = draw(wrong)
    return body


def encode(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


# ---- tests --------------------------------------------------------------------------


@FUZZ
@given(body=near_valid(chat=False))
def test_near_valid_completion_bodies(router, body):
    check_answer(router, *router.post_json("/v1/completions", encode(body)))


@FUZZ
@given(body=near_valid(chat=True))
def test_near_valid_chat_bodies(router, body):
    check_answer(router, *router.post_json("/v1/chat/completions", encode(body)))


@settings(FUZZ, max_examples=25)
@given(
    bodies=st.lists(st.tuples(st.booleans(), st.booleans()).flatmap(
        lambda c: st.tuples(st.just(c[0]), near_valid(chat=c[0]), st.just(c[1]))
    ), min_size=8, max_size=8),
)  # fmt: skip
def test_concurrent_bursts(router, bodies):
    """Eight at once, some with a huge max_tokens: load arithmetic meets other requests'
    load here (issue 9, finding 1: an overflow after dispatch leaked the ticket)."""

    def send(item: tuple[bool, dict[str, Any], bool]) -> tuple[int, dict[str, str], bytes]:
        chat, body, huge = item
        if huge:
            body = {**body, "max_tokens": 10**308}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return router.post_json(path, encode(body))

    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(send, bodies))
    for answer in answers:
        check_answer(router, *answer)


@settings(FUZZ, max_examples=60)
@given(body=json_values, chat=st.booleans())
def test_json_of_any_shape(router, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check_answer(router, *router.post_json(path, encode(body)))


@settings(FUZZ, max_examples=40)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode), chat=st.booleans())
def test_bytes_that_are_not_json(router, raw, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check_answer(router, *router.post_json(path, raw))


@settings(FUZZ, max_examples=30)
@given(depth=st.integers(50, 20_000), kind=st.sampled_from("[{m"), chat=st.booleans())
def test_deep_nesting(router, depth, kind, chat):
    if kind == "[":
        nested = "[" * depth + "]" * depth
    elif kind == "{":
        nested = '{"a":' * depth + "1" + "}" * depth
    else:  # nested chat content parts
        nested = '[{"type":"text","text":' * depth + '"x"' + "}]" * depth
    field = '"messages":[{"role":"user","content":%s}]' if chat else '"prompt":%s'
    raw = (f'{{"model":"{MODEL}",' + field % nested + "}").encode()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    check_answer(router, *router.post_json(path, raw[: MAX_BODY - 1]))


@settings(FUZZ, max_examples=20)
@given(size=st.integers(1, MAX_BODY), alphabet=st.sampled_from(["a ", "é€𝕂 ", "\x00\x01", " "]))
def test_huge_strings_up_to_the_body_limit(router, size, alphabet):
    head = b'{"model":"%s","max_tokens":1,"prompt":"' % MODEL.encode()
    unit = json.dumps(alphabet)[1:-1].encode()
    room = max(0, MAX_BODY - len(head) - 2)
    text = (unit * (size // len(unit) + 1))[: min(size, room)]
    text = text[: len(text) - len(text) % len(unit)]  # whole escape units only
    check_answer(router, *router.post_json("/v1/completions", head + text + b'"}'))


def test_body_over_the_limit_is_413(router):
    raw = b'{"model":"%s","prompt":"' % MODEL.encode() + b"x" * MAX_BODY + b'"}'
    status, _, body = router.post_json("/v1/completions", raw)
    assert status == 413 and is_openai_error(body)
    router.assert_settled()


# field-value characters (RFC 9110: VCHAR, SP, HTAB, obs-text); control bytes are framing
# errors, refused by the HTTP parser before the router sees them (test_raw_framing_errors)
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=300,
)


@settings(FUZZ, max_examples=60)
@given(
    auth=st.none() | header_text | st.just("Bearer ") | st.just("Basic " + "A" * 4000),
    request_id=st.none() | header_text | st.just("x" * 8000),
    content_type=st.none() | header_text | st.sampled_from(["text/plain", "text/json; x=é"]),
    stream=st.booleans(),
)  # fmt: skip
def test_odd_headers(router, auth, request_id, content_type, stream):
    headers = {}
    if auth is not None:
        headers["Authorization"] = auth
    if request_id is not None:
        headers["x-request-id"] = request_id
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = encode({"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": stream})
    status, got, answer = router.request("POST", "/v1/completions", body, headers)
    check_answer(router, status, got, answer)
    if status == 200 and request_id:
        assert "\r" not in got.get("x-request-id", "") and "\n" not in got.get("x-request-id", "")


def _status_of(raw: bytes) -> int | None:
    """The status of the first response in ``raw`` (None: the connection just closed)."""
    if not raw:
        return None
    line = raw.split(b"\r\n", 1)[0].split()
    assert len(line) >= 2 and line[0].startswith(b"HTTP/1."), raw[:200]
    return int(line[1])


BODY = b'{"model":"fuzz-model","prompt":"hi","max_tokens":2}'
RAW_CASES: dict[str, Callable[[], bytes]] = {
    "content-length larger than the body": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n" + BODY
    ),
    "content-length smaller than the body": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\n\r\n" + BODY
    ),
    "two content-lengths": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
    ),
    "negative content-length": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + BODY
    ),
    "huge content-length": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n"
        + BODY
    ),
    "bad chunk size": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n" + BODY + b"\r\n0\r\n\r\n"
    ),
    "chunked body over the limit": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + (b"%x\r\n" % 40_000 + b"x" * 40_000 + b"\r\n") * 2
        + b"0\r\n\r\n"
    ),
    "header line without colon": lambda: (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n"
    ),
    "bare LF line endings": lambda: (
        b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: %d\n\n" % len(BODY) + BODY
    ),
    "NUL in a header": lambda: b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "not HTTP at all": lambda: b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_raw_framing_errors(router, case):
    status = _status_of(router.raw(RAW_CASES[case]()))
    assert status is None or 200 <= status < 500, f"{case}: {status}"
    router.assert_settled()


def test_router_answers_normally_after_the_fuzzing(router):
    body = encode({"model": MODEL, "prompt": "still fine?", "max_tokens": 4})
    status, _, answer = router.post_json("/v1/completions", body)
    assert status == 200 and json.loads(answer)["choices"], answer
