"""Open-loop arrival times, as ``vllm bench serve`` draws them (pure: the rng is passed in).

Inter-arrival times are Gamma(shape=burstiness, scale=1 / (rate * burstiness)): mean
1/rate, burstiness 1.0 is Poisson, lower is burstier. With a known request count the
cumulative times are rescaled so the step spans exactly count / rate seconds, as vLLM
does. Several rates form a ladder of equal steps (by count, or by time when only a
duration is known). An infinite rate sends everything at once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence


def _step_offsets(
    rng: random.Random, rate: float, burstiness: float, count: int | None
) -> Iterator[float]:
    """Offsets from the step start; infinite when ``count`` is None."""
    if math.isinf(rate):
        yield from (0.0 for _ in (range(count) if count is not None else iter(int, 1)))
        return
    scale = 1.0 / (rate * burstiness)
    if count is None:
        t = 0.0
        while True:
            t += rng.gammavariate(burstiness, scale)
            yield t
    times, t = [], 0.0
    for _ in range(count):
        t += rng.gammavariate(burstiness, scale)
        times.append(t)
    factor = (count / rate) / times[-1] if times and times[-1] > 0 else 1.0
    yield from (x * factor for x in times)


def arrival_offsets(
    rng: random.Random,
    rates: Sequence[float],
    burstiness: float = 1.0,
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> Iterator[float]:
    """Send times in seconds from the run start, non-decreasing.

    Finite when ``num_requests`` is given; with only ``duration_s``, each ladder step
    lasts duration / len(rates) and the stream ends at the duration; with neither it is
    infinite (the caller stops it). An infinite rate without a count yields zeros
    forever: the caller bounds it by duration and concurrency.
    """
    if not rates or any(not r > 0 for r in rates):
        raise ValueError("rates must be a non-empty list of values > 0")
    if not burstiness > 0:
        raise ValueError("burstiness must be > 0")
    unbounded = duration_s is None or any(math.isinf(r) for r in rates)
    if num_requests is None and len(rates) > 1 and unbounded:
        raise ValueError("a rate ladder needs num_requests, or duration_s and finite rates")
    if num_requests is not None:
        return _counted_ladder(rng, rates, burstiness, num_requests)
    if duration_s is None or (len(rates) == 1 and math.isinf(rates[0])):
        return _step_offsets(rng, rates[0], burstiness, None)
    return _timed_ladder(rng, rates, burstiness, duration_s)


def _counted_ladder(
    rng: random.Random, rates: Sequence[float], burstiness: float, num_requests: int
) -> Iterator[float]:
    base, extra = divmod(num_requests, len(rates))
    start = 0.0
    for i, rate in enumerate(rates):
        count = base + (1 if i < extra else 0)
        for x in _step_offsets(rng, rate, burstiness, count):
            yield start + x
        if not math.isinf(rate):
            start += count / rate


def _timed_ladder(
    rng: random.Random, rates: Sequence[float], burstiness: float, duration_s: float
) -> Iterator[float]:
    step_s = duration_s / len(rates)
    for i, rate in enumerate(rates):
        for x in _step_offsets(rng, rate, burstiness, None):
            if x >= step_s:
                break
            yield i * step_s + x
