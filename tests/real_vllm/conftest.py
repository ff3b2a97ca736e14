"""Real-vLLM tests are opt-in: they run only with KVROUTE_REAL_VLLM=1 and .venv-vllm set up.

They start real vLLM CPU engines (minutes, gigabytes), so the default ``pytest`` run and
CI skip every test marked ``real_vllm``. Set up with ``scripts/real_vllm/setup.sh``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def real_vllm_skip_reason() -> str | None:
    """Why real-vLLM tests cannot run here, or None when they can."""
    if os.environ.get("KVROUTE_REAL_VLLM") != "1":
        return "opt-in: set KVROUTE_REAL_VLLM=1 (and run scripts/real_vllm/setup.sh)"
    if not VLLM_PYTHON.exists():
        return f"no vLLM venv at {VLLM_PYTHON.parent.parent}: run scripts/real_vllm/setup.sh"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = real_vllm_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if item.get_closest_marker("real_vllm") is not None:
            item.add_marker(skip)
