"""Where the control socket is, by the CLI contract: `--socket`, else
$SESSIOND_SOCKET, else /run/sessiond/sessiond.sock as root, else
$XDG_RUNTIME_DIR/sessiond/sessiond.sock (/tmp/sessiond-UID/... without it).
Shared by the daemon and every client."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_socket_path"]


def default_socket_path() -> Path:
    env = os.environ.get("SESSIOND_SOCKET")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/run/sessiond/sessiond.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sessiond-{os.getuid()}"
    return Path(runtime) / "sessiond" / "sessiond.sock"
