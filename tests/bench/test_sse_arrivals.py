"""SSE parsing fed raw bytes, and open-loop arrival times."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kvroute.bench.arrivals import arrival_offsets
from kvroute.bench.sse import SseDecoder, read_chunk


def test_decoder_joins_split_payloads_and_skips_the_rest():
    d = SseDecoder()
    assert d.feed(b': keep-alive\n\ndata: {"a"') == []
    assert d.feed(b": 1}\r\n\nevent: x\ndata:[DONE]\n") == ['{"a": 1}', "[DONE]"]
    assert d.feed(b"data: tail") == [] and d.flush() == ["tail"]


def test_chunks_of_completions_and_chat_streams():
    assert read_chunk('{"choices":[{"index":0,"text":" hi"}]}').text == " hi"
    role = read_chunk('{"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert not role.has_token
    assert read_chunk('{"choices":[{"delta":{"content":"x"}}]}').has_token
    usage = read_chunk(
        '{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
        '"prompt_tokens_details":{"cached_tokens":4}}}'
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (7, 3, 4)
    assert not usage.has_token
    assert read_chunk("[DONE]").done
    assert read_chunk('{"error":{"message":"boom"}}').error == "boom"
    assert read_chunk("not json").error


def test_counted_arrivals_span_exactly_n_over_rate():
    offsets = list(arrival_offsets(random.Random(1), (10.0,), num_requests=100))
    assert len(offsets) == 100 and offsets == sorted(offsets)
    assert offsets[-1] == pytest.approx(10.0)
    again = list(arrival_offsets(random.Random(1), (10.0,), num_requests=100))
    assert again == offsets


def test_infinite_rate_sends_at_once_and_ladders_step():
    assert list(arrival_offsets(random.Random(0), (math.inf,), num_requests=5)) == [0.0] * 5
    ladder = list(arrival_offsets(random.Random(0), (2.0, 4.0), num_requests=10))
    assert ladder[4] == pytest.approx(2.5) and ladder[-1] == pytest.approx(3.75)
    timed = list(arrival_offsets(random.Random(0), (50.0, 100.0), duration_s=2.0))
    first = [t for t in timed if t < 1.0]
    assert 30 < len(first) < 70 and 70 < len(timed) - len(first) < 130
    assert max(timed) < 2.0


def test_poisson_mean_gap_and_burstier_spread():
    def gaps(burstiness):
        it = arrival_offsets(random.Random(3), (5.0,), burstiness)
        times = [next(it) for _ in range(4000)]
        return [b - a for a, b in itertools.pairwise(times)]

    poisson, bursty = gaps(1.0), gaps(0.25)
    assert sum(poisson) / len(poisson) == pytest.approx(0.2, rel=0.1)
    assert sum(bursty) / len(bursty) == pytest.approx(0.2, rel=0.15)
    var = lambda xs: sum((x - 0.2) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert var(bursty) > 2 * var(poisson)  # Gamma shape 0.25: variance 4x Poisson's


def test_bad_arrival_settings_raise():
    with pytest.raises(ValueError):
        arrival_offsets(random.Random(0), (0.0,))
    with pytest.raises(ValueError):
        arrival_offsets(random.Random(0), (1.0, 2.0))  # ladder without a bound
    with pytest.raises(ValueError):
        arrival_offsets(random.Random(0), (1.0,), burstiness=0)
