"""`sessiond config default` prints every key: set ones with their default,
unset ones commented out, each unset one with its meaning."""

from __future__ import annotations

import re
import tomllib

import msgspec
import pytest

from supervisor.config import Config, default_toml, parse_config

pytestmark = pytest.mark.component


def _leaf_keys(obj: msgspec.Struct, path: str = "") -> dict[str, object]:
    keys: dict[str, object] = {}
    for attr, name in zip(type(obj).__struct_fields__, type(obj).__struct_encode_fields__):
        value = getattr(obj, attr)
        key = f"{path}.{name}" if path else name
        if isinstance(value, msgspec.Struct):
            keys.update(_leaf_keys(value, key))
        elif key == "mcp.listed":  # the daemon's, never a file's
            continue
        elif key not in ("permissions", "mcp.servers"):  # arrays of tables: shown by example
            keys[key] = value
    return keys


def test_default_toml_is_the_defaults_and_names_every_key() -> None:
    text = default_toml()
    assert parse_config(tomllib.loads(text), "default") == Config()
    # Which [section] each line is under, commented-out keys included.
    section, seen, meaning_above = "", set(), {}
    previous = ""
    for line in text.splitlines():
        if line.startswith("[") and not line.startswith("[["):
            section = line.strip("[]")
        bare = line[2:] if line.startswith("# ") else line
        if re.match(r"[a-z_]+ = ", bare):
            key = f"{section}.{bare.split(' = ')[0]}"
            seen.add(key)
            meaning_above[key] = previous.startswith("# ") and not re.match(r"# [a-z_]+ = ", previous)
        previous = line
    every = _leaf_keys(Config())
    assert set(every) <= seen, sorted(set(every) - seen)
    unset = [k for k, v in every.items() if v is None]
    assert {"agent.limits.memory_high_mb", "provider.base_url", "provider.model",
            "provider.api_key_env"} <= set(unset)
    for key in unset:
        assert f"# {key.rpartition('.')[2]} = " in text
        assert meaning_above[key], f"{key} has no meaning above it"
    # The meaning is the source's comment, not a second copy of it.
    assert "# Optional soft threshold: an event and a hint to the worker.\n# memory_high_mb = <integer>" in text
    assert "# [[permissions]]" in text
    assert "# [[mcp.servers]]" in text
