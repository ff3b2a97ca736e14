"""The effective configuration as YAML: what ``kvroute serve --print-config`` prints.

The document loads again as the same configuration (router/config.py): ``mode`` is
resolved, the Fleet's mode and session sizes appear where they are set (``mode``,
``sessions``), unset backend fields are left out. Secrets are printed as ``***``.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvroute.core.params import to_plain
from kvroute.router.config import FLEET_KEYS_SET_ELSEWHERE, RouterConfig

REDACTED = "***"  # what is printed for a secret


def config_to_mapping(config: RouterConfig) -> dict[str, Any]:
    """The effective configuration as the YAML document that would load it again:
    ``mode`` resolved, secrets as ``***``, backends without their unset fields."""
    out: dict[str, Any] = to_plain(config)
    out["mode"] = config.resolved_mode.value
    for key in FLEET_KEYS_SET_ELSEWHERE:
        del out["fleet"][key]
    out["backends"] = [_plain_backend(b) for b in out["backends"]]
    keys = out.pop("client_keys")
    out["clients"] = {"keys": [k | {"key": REDACTED} for k in keys]}
    if config.admin_key is not None:
        out["admin_key"] = REDACTED
    return out


def _plain_backend(backend: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in backend.items() if v is not None}
    if "api_key" in out:
        out["api_key"] = REDACTED
    return out


def dump_config(config: RouterConfig) -> str:
    """``config_to_mapping`` as YAML, in the order of the fields."""
    head = f"# effective kvroute configuration; secrets shown as {REDACTED!r}\n"
    body: str = yaml.safe_dump(config_to_mapping(config), sort_keys=False)
    return head + body
