"""What a person types that both sides check the same way (pure; run by the
daemon and by sessionctl): a session id, and a `--set KEY=VALUE` override.

Here, in ipc/, so that sessionctl checks its arguments without importing the
daemon's modules, and the daemon checks the same things with the same code.
"""

from __future__ import annotations

import re
from typing import Any

from ipc.errors import BadOverride

__all__ = ["parse_override", "valid_session_id"]

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def valid_session_id(session_id: str) -> bool:
    return _SESSION_ID.fullmatch(session_id) is not None


def parse_override(item: str) -> tuple[str, Any]:
    """`KEY=VALUE` from the command line; VALUE is read as a TOML value
    (64, 1.5, true, "text", ["a", "b"]) and as a plain string otherwise."""
    # Here, not at the top: sessionctl's commands that take no --set skip it.
    import tomllib

    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise BadOverride(f"--set {item!r}: expected KEY=VALUE")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value
