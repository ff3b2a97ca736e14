"""Profiles: the built-in table, YAML user profiles and range checks."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from kvroute.engine import PROFILES, EngineProfile
from kvroute.sim.profiles import get_profile, load_profile

TABLE = {  # docs/engine-model.md: kv tokens, t_fwd0, b, c, k_ctx, a_api
    "llama-3.1-8b-a100": (440_000, 12, 0.090, 3.4e-6, 1.26e-4, 15),
    "codellama-13b-a100": (58_000, 19, 0.160, 5.3e-6, 7.9e-4, 15),
    "codellama-13b-a100-40g": (9_000, 19, 0.160, 5.3e-6, 7.9e-4, 15),
    "llama-3.1-70b-a100-tp4": (470_000, 26, 0.250, 4.2e-6, 7.9e-5, 15),
    "llama-3.1-8b-h100": (440_000, 8, 0.028, 1.1e-6, 7.7e-5, 15),
    "codellama-13b-h100": (58_000, 13, 0.050, 1.7e-6, 4.9e-4, 15),
    "llama-3.1-70b-h100-tp4": (470_000, 17, 0.074, 1.3e-6, 4.8e-5, 15),
    "tiny": (8_192, 1, 0.010, 0, 0, 1),
    "instant": (1_000_000, 0, 0, 0, 0, 0),
}


def test_builtin_profiles_match_the_table() -> None:
    assert set(PROFILES) == set(TABLE)
    for name, row in TABLE.items():
        p = PROFILES[name]
        got = (p.kv_capacity_tokens, p.t_fwd0_ms, p.b_ms_per_token, p.c_ms_per_pair)
        assert (*got, p.k_ctx_ms_per_token, p.a_api_ms) == row, name
        assert p.block_size == 16 and p.name == name
        if name != "instant":
            assert (p.max_num_seqs, p.max_num_batched_tokens) == (256, 8192)
    assert PROFILES["codellama-13b-a100"].num_gpu_blocks == 3625
    assert PROFILES["codellama-13b-a100-40g"].max_model_len == 8192
    assert {n for n, p in PROFILES.items() if p.gpus != 1} == {n for n in TABLE if "tp4" in n}
    assert all(PROFILES[n].gpus == 4 for n in TABLE if "tp4" in n)


def test_get_profile_by_name_and_unknown_name_lists_known() -> None:
    assert get_profile("tiny") is PROFILES["tiny"]
    with pytest.raises(ValueError, match=re.escape("llama-3.1-8b-h100")):
        get_profile("no-such-gpu")


def test_yaml_profile_round_trip(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "my-gpu.yaml"
    path.write_text(
        "block_size: 32\nkv_capacity_tokens: 100000\nt_fwd0_ms: 10\nb_ms_per_token: 0.05\n"
        "c_ms_per_pair: 2.0e-6\nk_ctx_ms_per_token: 1.0e-4\na_api_ms: 12\nmax_num_seqs: 64\n"
    )
    profile = get_profile(str(path))
    assert profile == load_profile(path)
    assert profile.name == "my-gpu" and profile.block_size == 32
    assert profile.num_gpu_blocks == 3125 and profile.max_num_seqs == 64
    assert profile.max_num_batched_tokens == 8192


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("block_size: 16\n", "missing"),
        ("- just\n- a list\n", "mapping"),
        ("name: x\nblock_size: 16\nkv_capacity_tokens: 1000\nt_fwd0_ms: 1\nb_ms_per_token: 0\n"
         "c_ms_per_pair: 0\nk_ctx_ms_per_token: 0\na_api_ms: 0\nwarp_speed: 9\n", "warp_speed"),
        ("name: x\nblock_size: 0\nkv_capacity_tokens: 1000\nt_fwd0_ms: 1\nb_ms_per_token: 0\n"
         "c_ms_per_pair: 0\nk_ctx_ms_per_token: 0\na_api_ms: 0\n", "block_size"),
        ("name: x\nblock_size: 16\nkv_capacity_tokens: 1000\nt_fwd0_ms: -1\nb_ms_per_token: 0\n"
         "c_ms_per_pair: 0\nk_ctx_ms_per_token: 0\na_api_ms: 0\n", "t_fwd0_ms"),
        ("a: [unclosed\n", "YAML"),
    ],
)  # fmt: skip
def test_bad_yaml_profiles_raise_value_error(
    tmp_path: pathlib.Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_profile(path)


def test_missing_yaml_file_is_a_value_error(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        get_profile(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 1.5),
        ("c_ms_per_pair", float("nan")),
        ("block_size", True),
        ("max_model_len", 100_000),  # larger than the tiny cache
        ("kv_capacity_tokens", 8),  # less than one block
        ("name", ""),
    ],
)
def test_out_of_range_fields_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field if field != "kv_capacity_tokens" else "block"):
        dataclasses.replace(PROFILES["tiny"], **{field: value})


def test_profile_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PROFILES["tiny"].block_size = 32  # type: ignore[misc]
    assert isinstance(PROFILES["tiny"], EngineProfile)
