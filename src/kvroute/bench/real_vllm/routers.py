"""A fresh ``kvroute serve`` per mode in front of the real engines, and its view."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.bench.procs import free_port
from kvroute.bench.real_vllm.engines import Proc, http, spawn, wait_healthy

ADMIN_KEY = "real-vllm-e2e-admin"
POLICY_OF = {"exact": "prefix", "approx": "prefix", "round_robin": "round_robin"}


def kvroute_bin() -> Path:
    return Path(sys.executable).parent / "kvroute"


def router_env(venv: Path, run_dir: Path) -> dict[str, str]:
    """The router's environment; borrows tokenizers + jinja2 from the vLLM venv if needed.

    Exact keys on a real model need both packages in the router's Python. When they are
    missing there and the vLLM venv has the same Python version, a folder of symlinks to
    just those packages goes first on the router's PYTHONPATH (nothing is installed).
    """
    env = dict(os.environ)
    probe = [sys.executable, "-c", "import tokenizers, jinja2"]
    if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
        return env
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = (venv / "lib" / version / "site-packages").resolve()
    names = ("tokenizers", "jinja2", "markupsafe")
    if not all((site / n).is_dir() for n in names):
        return env
    extras = run_dir / "router-extras"
    extras.mkdir(exist_ok=True)
    for name in names:
        if not (extras / name).exists():
            (extras / name).symlink_to(site / name, target_is_directory=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extras), env.get("PYTHONPATH")) if p)
    return env


def exact_mode_missing(env: dict[str, str]) -> str | None:
    """Why the router cannot run exact mode on this model, or None when it can.

    Needs ``kvroute serve --mode`` and, for a real model's token ids, ``tokenizers`` and
    ``jinja2`` importable by the router (see ``router_env``).
    """
    out = subprocess.run(
        [str(kvroute_bin()), "serve", "--help"], capture_output=True, text=True, check=False
    )
    if "--mode" not in out.stdout:
        return "TODO: kvroute serve has no --mode exact yet"
    probe = [sys.executable, "-c", "import tokenizers, jinja2"]
    if subprocess.run(probe, capture_output=True, check=False, env=env).returncode != 0:
        return f"TODO: exact keys need tokenizers + jinja2 in {Path(sys.executable).parent.parent}"
    return None


def router_config(engines: list[Proc], model_dir: Path, path: Path) -> Path:
    """YAML for exact mode: each backend with its KV-event endpoint, the model's tokenizer."""
    lines = ["mode: exact", "tokenizers:", f"  tiny: {model_dir.resolve()}", "backends:"]
    for e in engines:
        lines += [f"  - url: {e.url}", f"    kv_events: {e.kv_endpoint}"]
        lines += [f"    kv_replay: {e.kv_replay}"] if e.kv_replay else []
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass(frozen=True, slots=True)
class RouterSetup:
    """What every router start needs besides the mode."""

    model_dir: Path  # the model's tokenizer (exact keys)
    env: dict[str, str]  # the router's environment (router_env)
    run_dir: Path  # logs and generated configs
    repo: Path  # working directory of the processes (the repository)


def start_router(mode: str, engines: list[Proc], setup: RouterSetup) -> Proc:
    port = free_port()
    argv = [str(kvroute_bin()), "serve", "--port", str(port), "--policy", POLICY_OF[mode]]
    argv += ["--admin-key", ADMIN_KEY, "--log-level", "WARNING"]
    if mode == "exact":
        config = router_config(engines, setup.model_dir, setup.run_dir / "exact.yaml")
        argv += ["--mode", "exact", "--config", str(config)]
    else:
        for e in engines:
            argv += ["--backend", e.url]
    url = f"http://127.0.0.1:{port}"
    return spawn(f"router-{mode}", argv, setup.env, setup.run_dir, url, setup.repo)


def admin_rows(router: Proc) -> list[dict[str, Any]]:
    body = http("GET", f"{router.url}/admin/backends", Authorization=f"Bearer {ADMIN_KEY}")
    return list(body["backends"])


def wait_router_ready(router: Proc, n: int, timeout_s: float = 60.0) -> None:
    """Healthy, and every backend scraped once (so block size and capacity are known)."""
    wait_healthy([router], timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = admin_rows(router)
        ready = [
            r
            for r in rows
            if r["kvroute_backend_healthy"] and r["kvroute_backend_engine_kv_usage"] is not None
        ]
        if len(ready) == n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"router backends not ready after {timeout_s:.0f} s:\n{router.log_tail()}")
