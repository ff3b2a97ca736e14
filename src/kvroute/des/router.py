"""The router in the loop: kvroute's own Fleet and policy, fed what the live router is fed.

A ``SimRouter`` is built from a ``--routers`` name exactly as ``kvroute compare`` starts
``kvroute serve`` (the same config loader, so the same defaults: policy parameters, cost
model, sessions, scrape interval), and learns only what the live router learns, when it
would learn it: each dispatch; the first token of each stream (the prefill rate); the
engine's usage at the end of a stream (cached tokens; in approximate mode the tokens
its text stood for); the end of each request; a /metrics scrape of every engine each
``health.scrape_interval_s`` (a peer model's ``metrics_interval_s`` where its router
reads metrics at its own pace); in exact mode each engine's KV event batches, a fixed
delay after the step that published them. Keys are what the live router computes:
text keys of the prompt and a token estimate from its bytes in approximate mode, the
engine's token ids in exact mode. There is no second copy of a policy, the cost model
or the index: they are core's, called as the proxy calls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.bench.procs import NO_BACKENDS, RouterSpec, check_router_owns
from kvroute.common.kv_events import KvEvent
from kvroute.core.fleet import Fleet
from kvroute.core.load import Ticket
from kvroute.core.policy import make_policy
from kvroute.core.policy.base import Decision, RouteRequest
from kvroute.des.prepare import Prepared
from kvroute.engine.engine import EngineStats
from kvroute.router.config import RouterConfig, load_config, read_yaml
from kvroute.router.route_request import session_hint


@dataclass(frozen=True, slots=True)
class Routed:
    """Where one request went: what the proxy holds while it relays the answer."""

    decision: Decision
    ticket: Ticket
    text_bytes: int | None  # UTF-8 bytes keyed as text (approximate mode), else None

    def headers(self) -> dict[str, Any]:
        """The record fields the live router's answer headers give the client (the
        ``x-kvroute-`` backend, decision, predicted and left cached tokens)."""
        d = self.decision
        return {
            "backend": d.backend,
            "decision": str(d.reason),
            "predicted_cached_tokens": self.ticket.predicted_cached_tokens,
            "left_cached_tokens": d.left_cached_tokens,
        }


def router_config(
    spec: RouterSpec, urls: Sequence[str], config_path: str | None = None
) -> RouterConfig:
    """The configuration ``kvroute serve --config config_path`` would run ``spec`` with
    in front of ``urls``."""
    if spec.kind != "kvroute":
        raise ValueError(
            f"{spec.name}: kvroute simulate runs kvroute's own policies; the real "
            f"{spec.kind} runs only in `kvroute compare`"
        )
    args = dict(arg.split("=", 1) for arg in spec.policy_args)
    try:  # the file is read once; one that lists backends adds to the fleet's: refused
        if config_path is not None:
            check_router_owns(read_yaml(config_path), spec, config_path)
        config = load_config(
            config_path,
            backends=urls,
            overrides={"policy": spec.policy, "mode": spec.mode},
            policy_args=args or None,
        )
    except OSError as exc:
        raise ValueError(f"router config {config_path}: {exc.strerror or exc}") from None
    if len(config.backends) != len(urls):
        raise ValueError(f"router config {config_path} lists backends: {NO_BACKENDS}")
    return config


class SimRouter:
    """A Fleet and its inputs in virtual time (module doc)."""

    def __init__(
        self,
        spec: RouterSpec,
        urls: Sequence[str],
        model: str,
        config_path: str | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.spec = spec
        self.max_model_len = max_model_len  # what the live router reads off /v1/models
        self.config = router_config(spec, urls, config_path)
        self.fleet = Fleet(
            make_policy(self.config.policy, self.config.policy_params), self.config.fleet
        )
        self.model = model
        self.exact = spec.mode == "exact"
        self._kv_seq = dict.fromkeys(urls, 0)
        for url in urls:
            self.fleet.add_backend(url, models=(model,))
            if self.exact:
                self.fleet.kv_history_empty(url)  # a fresh engine: nothing published yet
        # a peer model scrapes as the router it models does (llm-d: every 50 ms)
        modelled = type(self.fleet.policy).metrics_interval_s
        self.scrape_interval_s = modelled or self.config.health.scrape_interval_s
        # requests routed under each verdict of the fleet's reuse regime (True: spread,
        # False: reuse past the residency, None: undecided), as kvroute's policy saw it
        self.regime_requests: dict[bool | None, int] = {True: 0, False: 0, None: 0}

    def route(
        self,
        at: float,
        request_id: str,
        prompt: Prepared,
        max_tokens: int,
        headers: Sequence[tuple[str, str]],
    ) -> Routed | None:
        """Decide and dispatch one request at ``at`` (None: no backend may take it).

        ``prompt``: its ids and keys (des/prepare.py); exact mode routes on the engines'
        block hashes, approximate mode on the text's keys, cut at the engines' block size
        (the router's key block size once it scraped them, at t = 0)."""
        fleet, model = self.fleet, self.model
        text_bytes: int | None = None
        keys: Sequence[int]
        num_tokens = len(prompt.token_ids)
        if fleet.key_kind_for(model) == "tokens":
            keys = prompt.token_hashes  # the engines' block size: the one exact mode keys with
        else:
            if fleet.block_size_for(model) != prompt.key_block_size:
                raise RuntimeError(
                    f"the router keys text at {fleet.block_size_for(model)} tokens a block, "
                    f"the simulator prepared keys at {prompt.key_block_size}"
                )
            keys, text_bytes = prompt.text_keys, prompt.text_bytes
            num_tokens = fleet.prompt_tokens_estimate(model, text_bytes)
        session = session_hint(dict(headers), {}, self.config.sessions)
        cacheable = fleet.cacheable(model, num_tokens, self.max_model_len)
        req = RouteRequest(request_id, model, keys, num_tokens, max_tokens, session, cacheable)
        self.regime_requests[fleet.reuse.concave] += 1
        decision = fleet.route(req, at)
        if decision is None:
            return None
        return Routed(decision, fleet.dispatch(decision, req, at), text_bytes)

    def reuse_regime(self) -> dict[str, float]:
        """How the fleet's reuse regime (core/reuse_regime.py) stood: the requests routed
        under each verdict, and its late and ghost votes at the end."""
        r, n = self.fleet.reuse, self.regime_requests
        return {
            "requests_spread": n[True],
            "requests_past_residency": n[False],
            "requests_undecided": n[None],
            "late_at_end": round(r.late, 3),
            "ghost_at_end": round(r.ghost, 3),
        }

    def first_token(self, routed: Routed, at: float) -> None:
        self.fleet.on_first_token(routed.ticket, at)

    def finished(
        self, routed: Routed, at: float, *, prompt_tokens: int, cached_tokens: int
    ) -> None:
        """The stream's last chunk (usage) came, then its end."""
        fleet = self.fleet
        fleet.record_cached_tokens(routed.ticket, cached_tokens)
        if routed.text_bytes is not None:
            fleet.observe_prompt_tokens(self.model, routed.text_bytes, prompt_tokens)
        fleet.finish(routed.ticket, at, True)

    def refused(self, routed: Routed, at: float) -> None:
        """The engine answered 4xx: the proxy relays it, and the backend did not fail."""
        self.fleet.finish(routed.ticket, at, True)

    def scraped(self, url: str, stats: EngineStats) -> None:
        self.fleet.update_engine_stats(
            url,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            block_size=stats.block_size,
            num_gpu_blocks=stats.num_gpu_blocks,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_queries=stats.prefix_cache_queries,
        )

    def kv_batch(self, url: str, published_at: float, events: list[KvEvent], at: float) -> None:
        """One engine step's KV events, published at ``published_at``, received at ``at``."""
        seq = self._kv_seq[url]
        self._kv_seq[url] = seq + 1
        self.fleet.apply_kv_batch(url, seq, published_at, events, at, lag_s=at - published_at)
