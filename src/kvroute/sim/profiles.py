"""Engine profiles by name or from a YAML file: what ``--profile`` accepts.

The built-in table and the range checks are ``engine/profiles.py``, which is pure;
reading a user's file is I/O, so it lives here, with the simulator that starts engines
(the benchmarks import it from here as well).
"""

from __future__ import annotations

import dataclasses
import pathlib

import yaml

from kvroute.engine.profiles import PROFILES, EngineProfile


def load_profile(path: str | pathlib.Path) -> EngineProfile:
    """Read a user profile from YAML (a mapping with EngineProfile's field names)."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"profile {str(path)!r}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"profile {str(path)!r}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"profile {str(path)!r}: expected a mapping of profile fields")
    known = {f.name for f in dataclasses.fields(EngineProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"profile {str(path)!r}: unknown fields {unknown}")
    data.setdefault("name", pathlib.Path(path).stem)
    try:
        return EngineProfile(**data)
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"profile {str(path)!r}: {exc}") from None


def get_profile(name_or_yaml_path: str) -> EngineProfile:
    """A built-in profile by name, or a YAML file's profile when given a path."""
    if name_or_yaml_path in PROFILES:
        return PROFILES[name_or_yaml_path]
    if name_or_yaml_path.endswith((".yaml", ".yml")) or pathlib.Path(name_or_yaml_path).is_file():
        return load_profile(name_or_yaml_path)
    raise ValueError(
        f"unknown engine profile {name_or_yaml_path!r}; known: {', '.join(PROFILES)}"
        " (or a path to a YAML file)"
    )
