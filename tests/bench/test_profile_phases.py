"""The profile's phase table counts each sample once, in the phase nearest its leaf."""

from kvroute.bench.perf.profile import phase_shares

HANDLE = "main (a.py:1);_handle (kvroute/router/proxy.py:60)"
STACKS = f"""\
{HANDLE};Fleet.route (kvroute/core/fleet.py:1);choose (p.py:2) 30
{HANDLE};open_upstream (u.py:3);_request (aiohttp/client.py:9) 50
{HANDLE};new_request_id (r.py:4) 10
main (a.py:1);Runner.run (asyncio/runners.py:1) 10
not a stack line
"""


def test_each_sample_lands_in_one_phase() -> None:
    shares = dict(phase_shares(STACKS))
    assert shares == {
        "upstream request (aiohttp client)": 0.5,
        "routing: choose": 0.3,
        "request glue (ids, metrics, headers)": 0.1,
        "idle (event loop, thread pool)": 0.1,
    }
