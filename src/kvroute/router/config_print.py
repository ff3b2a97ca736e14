"""The effective configuration as YAML: what ``kvroute serve --print-config`` prints.

The document loads again as the same configuration (router/config.py): ``mode`` is
resolved, the Fleet's mode and session sizes appear where they are set (``mode``,
``sessions``), unset backend fields are left out. A secret read from ``env:NAME`` is
printed as that reference, any other as ``***``, which the loader refuses.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvroute.core.params import to_plain
from kvroute.router.config import FLEET_KEYS_SET_ELSEWHERE, REDACTED, EnvSecret, RouterConfig
from kvroute.router.config_sections import BackendConfig


def config_to_mapping(config: RouterConfig) -> dict[str, Any]:
    """The effective configuration as the YAML document that would load it again:
    ``mode`` resolved, secrets hidden (``_shown``), backends without their unset fields."""
    out: dict[str, Any] = to_plain(config)
    out["mode"] = config.resolved_mode.value
    for key in FLEET_KEYS_SET_ELSEWHERE:
        del out["fleet"][key]
    plain = zip(out["backends"], config.backends, strict=True)
    out["backends"] = [_plain_backend(b, c) for b, c in plain]
    keys = out.pop("client_keys")
    shown = [_shown(k.key) for k in config.client_keys]
    out["clients"] = {"keys": [k | {"key": s} for k, s in zip(keys, shown, strict=True)]}
    if config.admin_key is not None:
        out["admin_key"] = _shown(config.admin_key)
    return out


def _shown(secret: str) -> str:
    """What is printed for a secret: its ``env:NAME`` reference, else the placeholder."""
    return secret.ref if isinstance(secret, EnvSecret) else REDACTED


def _plain_backend(backend: dict[str, Any], config: BackendConfig) -> dict[str, Any]:
    out = {k: v for k, v in backend.items() if v is not None}
    if config.api_key is not None:
        out["api_key"] = _shown(config.api_key)
    return out


def dump_config(config: RouterConfig) -> str:
    """``config_to_mapping`` as YAML, in the order of the fields."""
    head = f"# effective kvroute configuration; secrets shown as {REDACTED!r} or env:NAME\n"
    body: str = yaml.safe_dump(config_to_mapping(config), sort_keys=False)
    return head + body
