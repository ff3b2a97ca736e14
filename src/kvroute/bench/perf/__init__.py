"""What the router itself costs: micro-benchmarks and throughput runs.

Each module is runnable (``python -m kvroute.bench.perf.<name> --help``) and has a thin
script in ``scripts/``; each prints its figures and asserts nothing (timings are
reported, never tested: the machines are noisy).

- ``choose``: ``Fleet.route`` (+ dispatch + finish) per decision on 8 and 1,024 backends.
- ``bus``: CPU a worker spends replaying one peer's request (``--workers N``).
- ``listener``: what the client-connection guard costs per request, and one sweep.
- ``overhead``: the same requests direct to an instant backend and through the router.
- ``workers``: router throughput and engine-measured hit rate with N workers.
- ``tokenizer``: exact-mode throughput with a real model's tokenizer.
- ``clients``: the load generators those runs share (a bare HTTP/1.1 client, wrk).
"""
