"""``kvroute serve`` flags of exact mode (KV events, tokenizers), kept apart from cli.py.

--mode exact|approximate|auto
--kv-events http://127.0.0.1:8001=tcp://127.0.0.1:5557      (repeatable, per backend)
--kv-replay http://127.0.0.1:8001=tcp://127.0.0.1:5600      (repeatable, optional)
--tokenizer meta-llama/Llama-3.1-8B=/models/llama/          (repeatable, per model)
"""

from __future__ import annotations

import argparse
from typing import Any

from kvroute.router.config import parse_pairs


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """Add the exact-mode flags to the ``serve`` parser."""
    p.add_argument(
        "--mode",
        choices=("approximate", "exact", "auto"),
        help="routing keys: approximate (text, cache models fed by dispatches), exact "
        "(engine token ids, views from KV events), auto (exact per model while a backend's "
        "event stream is synced). Default: auto when a backend has KV events, else approximate",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="KV-event PUB endpoint of a backend, e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5557 "
        "(repeatable)",
    )
    p.add_argument(
        "--kv-replay",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="KV-event replay (ROUTER) endpoint of a backend: fills gaps, syncs a late start",
    )
    p.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH",
        help="exact keys for MODEL from PATH/tokenizer.json (+ chat template); default: the "
        "built-in tokenizer, which matches kvroute sim (needs: pip install tokenizers jinja2)",
    )


def kv_load_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``load_config`` keyword arguments from the parsed flags (ValueError on bad pairs)."""
    return {
        "kv_events": parse_pairs(getattr(args, "kv_events", []), "--kv-events"),
        "kv_replay": parse_pairs(getattr(args, "kv_replay", []), "--kv-replay"),
        "tokenizers": parse_pairs(getattr(args, "tokenizer", []), "--tokenizer"),
    }
