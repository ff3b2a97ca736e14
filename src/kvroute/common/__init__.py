"""The bottom layer: what the engine model, the router's core, the simulator and the
benchmarks all speak. Pure (no I/O, no clock, no global random) and importing nothing
else of kvroute, so every other package can stand on it.

- ``hashing``: chained block hashes of token ids and of text (the engine's and the
  router's cache keys), and the chain root of a salted or LoRA request;
- ``tokenizer``: the built-in deterministic tokenizer;
- ``chat``: the chat template (``render_chat``) the simulator and the router share;
- ``kv_events``: the KV-cache event types and their msgpack wire codec (vLLM's format).
- ``vllm_metrics``: the parser of vLLM's ``/metrics`` page (the router's scraper and
  the benchmarks read the same series).
"""
