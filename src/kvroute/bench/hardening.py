"""What the soak and chaos runs share: the router's metrics and /proc figures, and a
mixed client load whose every request gets an outcome (their processes are in
bench/harness_procs.py).

The load is closed-loop: each user sends one request, waits for the
whole answer (or cuts it on purpose), thinks, and sends the next; the mix is seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvroute.bench.sse import SseDecoder, read_chunk

# ---- what the router exposes ---------------------------------------------------------


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> family/sample name -> {backend label ("" if none): value}."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[s.labels.get("backend", "")] = s.value
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, float]]:
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return parse_metrics(await resp.text())


def per_backend(metrics: Mapping[str, Mapping[str, float]], name: str) -> dict[str, float]:
    return dict(metrics.get(name, {}))


def total(metrics: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    values = metrics.get(name)
    return None if values is None else float(sum(values.values()))


def proc_figures(pid: int) -> tuple[float, int]:
    """(resident set in MiB, open file descriptors) of a live process, from /proc."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
                break
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def router_load(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(requests, tokens) the router holds in flight over all backends (tickets)."""
    m = await scrape(session, url)
    reqs = total(m, "kvroute_backend_router_in_flight_requests") or 0.0
    return reqs, total(m, "kvroute_backend_in_flight_tokens") or 0.0


async def wait_load_zero(session: aiohttp.ClientSession, url: str, timeout_s: float) -> bool:
    """Poll until the router holds no load (True), or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            if await router_load(session, url) == (0.0, 0.0):
                return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.25)


# ---- the load ------------------------------------------------------------------------

# request kind -> weight; the malformed kinds must be answered 4xx with an OpenAI error
DEFAULT_MIX: dict[str, float] = {
    "chat_stream": 30,
    "chat": 20,
    "completion_stream": 20,
    "completion": 16,
    "disconnect": 6,  # a stream the client closes after a few chunks
    "bad_json": 2,
    "wrong_type": 2,
    "unknown_model": 2,
    "too_large": 2,
}
MALFORMED = frozenset({"bad_json", "wrong_type", "unknown_model", "too_large"})
_JSON = {"Content-Type": "application/json"}
_WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma", "theta", "zeta")


@dataclass(frozen=True, slots=True)
class Shot:
    """One request and what came of it."""

    kind: str  # request kind (DEFAULT_MIX keys)
    t0_s: float  # sent, seconds since the load started
    t1_s: float  # answer over (or given up)
    status: int | None  # HTTP status; None when no response came
    failure: str | None  # None: as expected; else what went wrong (see MixedLoad._shoot)
    backend: str | None  # x-kvroute-backend of the answer
    detail: str = ""  # error text, for the report


@dataclass
class LoadStats:
    """Live counters for the progress display."""

    sent: int = 0
    done: int = 0
    by_failure: Counter[str] = field(default_factory=Counter)


class MixedLoad:
    """Closed-loop users sending a seeded mix of requests (module doc)."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        seed: int = 0,
        users: int = 8,
        think_s: tuple[float, float] = (0.0, 0.2),
        mix: Mapping[str, float] | None = None,
        max_body_bytes: int = 262_144,
        client_timeout_s: float = 30.0,
        num_groups: int = 6,
    ) -> None:
        self.url = url
        self.model = model
        self.users = users
        self.think_s = think_s
        self.mix = dict(mix or DEFAULT_MIX)
        self.max_body_bytes = max_body_bytes
        self.timeout = aiohttp.ClientTimeout(total=client_timeout_s)
        self._rng = random.Random(seed)
        self._prefixes = [self._text(f"group{g}", 120) for g in range(num_groups)]
        self.shots: list[Shot] = []
        self.stats = LoadStats()
        self._t0 = 0.0

    def _text(self, tag: str, words: int) -> str:
        rng = self._rng
        return (
            tag + " " + " ".join(f"{rng.choice(_WORDS)}{rng.randrange(50)}" for _ in range(words))
        )

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def run(self, stop: asyncio.Event, t0: float | None = None) -> list[Shot]:
        """Send until ``stop`` is set; every request started is finished or cut first."""
        self._t0 = time.monotonic() if t0 is None else t0
        connector = aiohttp.TCPConnector(limit=self.users * 2)
        async with aiohttp.ClientSession(connector=connector, timeout=self.timeout) as session:
            await asyncio.gather(*(self._user(session, stop, u) for u in range(self.users)))
        return self.shots

    async def _user(self, session: aiohttp.ClientSession, stop: asyncio.Event, u: int) -> None:
        rng = random.Random(self._rng.random())
        kinds, weights = list(self.mix), list(self.mix.values())
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            path, body, stream = self._request(kind, rng)
            self.stats.sent += 1
            shot = await self._shoot(session, kind, path, body, stream)
            self.shots.append(shot)
            self.stats.done += 1
            if shot.failure:
                self.stats.by_failure[shot.failure] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.uniform(*self.think_s))

    def _request(self, kind: str, rng: random.Random) -> tuple[str, bytes, bool]:
        """(path, body bytes, streamed) of one request of ``kind``."""
        chat = kind.startswith("chat") or (
            kind in MALFORMED | {"disconnect"} and rng.random() < 0.5
        )
        path = "/v1/chat/completions" if chat else "/v1/completions"
        prefix = rng.choice(self._prefixes)
        question = f"q{rng.randrange(1_000_000)} " + " ".join(rng.choices(_WORDS, k=20))
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(4, 24)}
        if chat:
            body["messages"] = [
                {"role": "system", "content": prefix},
                {"role": "user", "content": question},
            ]
        else:
            body["prompt"] = prefix + " " + question
        body["stream"] = kind.endswith("_stream") or kind == "disconnect"
        if kind == "disconnect":
            body["max_tokens"] = 200
        elif kind == "wrong_type":
            field_name, value = rng.choice(
                [("max_tokens", "ten"), ("stream", "yes"), ("model", 7), ("max_tokens", -3)]
            )
            body[field_name] = value
            if chat and rng.random() < 0.3:
                body["messages"] = "not a list"
        elif kind == "unknown_model":
            body["model"] = f"no-such-model-{rng.randrange(1000)}"
        raw = json.dumps(body).encode()
        if kind == "bad_json":
            raw = raw[: rng.randrange(1, len(raw) - 1)]
        elif kind == "too_large":
            raw = raw[:-1] + b', "pad": "' + b"x" * (self.max_body_bytes + 1024) + b'"}'
        return path, raw, body["stream"] is True

    async def _shoot(
        self, session: aiohttp.ClientSession, kind: str, path: str, raw: bytes, stream: bool
    ) -> Shot:
        """Send one request. Failures: ``http_<status>``, ``wrong_status`` (a malformed
        request not refused, or a valid one refused), ``bad_error_body``, ``bad_answer``,
        ``stream_error`` (an error event in the stream), ``stream_cut`` (no [DONE]),
        ``timeout``, ``connect`` (the router itself unreachable), ``client_error``."""
        t0 = self.now()
        status: int | None = None
        backend: str | None = None

        def shot(failure: str | None, detail: str = "") -> Shot:
            return Shot(kind, t0, self.now(), status, failure, backend, detail[:300])

        try:
            async with session.post(self.url + path, data=raw, headers=_JSON) as resp:
                status, backend = resp.status, resp.headers.get("x-kvroute-backend")
                if kind in MALFORMED:
                    return shot(*await _judge_refusal(resp))
                if status != 200:
                    text = (await resp.read())[:300].decode("utf-8", "replace")
                    return shot("wrong_status" if status < 500 else f"http_{status}", text)
                if stream:
                    cut_after = 3 if kind == "disconnect" else None
                    return shot(*await _read_stream(resp, cut_after))
                data = await resp.json(content_type=None)
                ok = isinstance(data, dict) and isinstance(data.get("choices"), list)
                return shot(None if ok else "bad_answer", "" if ok else str(data))
        except TimeoutError:
            return shot("timeout")
        except aiohttp.ClientConnectorError as exc:
            return shot("connect", str(exc))
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            failure = "stream_cut" if status == 200 else "client_error"
            return shot(failure, f"{type(exc).__name__}: {exc}")


async def _judge_refusal(resp: aiohttp.ClientResponse) -> tuple[str | None, str]:
    """A malformed request: 4xx with an OpenAI error object, or a failure."""
    text = (await resp.read()).decode("utf-8", "replace")
    if resp.status >= 500:
        return f"http_{resp.status}", text
    if resp.status < 400:
        return "wrong_status", f"{resp.status}: {text[:200]}"
    return (None, "") if is_openai_error(text) else ("bad_error_body", text)


def is_openai_error(text: str | bytes) -> bool:
    """``{"error": {"message": str, "type": str, ...}}``."""
    try:
        data = json.loads(text)
    except ValueError:
        return False
    err = data.get("error") if isinstance(data, dict) else None
    return (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
    )


async def _read_stream(
    resp: aiohttp.ClientResponse, cut_after: int | None
) -> tuple[str | None, str]:
    """Read an SSE answer to its [DONE] (or close it after ``cut_after`` payloads)."""
    decoder = SseDecoder()
    num_payloads = 0
    async for data in resp.content.iter_any():
        for payload in decoder.feed(data):
            chunk = read_chunk(payload)
            if chunk.error:
                return "stream_error", chunk.error
            if chunk.done:
                return None, ""
            num_payloads += 1
            if cut_after is not None and num_payloads >= cut_after:
                resp.close()  # the client goes away mid-stream
                return None, ""
    return "stream_cut", f"ended after {num_payloads} payloads without [DONE]"


def count_by(shots: Sequence[Shot], key: Any) -> dict[str, int]:
    return dict(Counter(key(s) for s in shots).most_common())
