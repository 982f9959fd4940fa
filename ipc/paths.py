"""Where the control socket is, by the CLI contract: `--socket`, else
$SESSIOND_SOCKET, else /run/sessiond/sessiond.sock as root, else
$XDG_RUNTIME_DIR/sessiond/sessiond.sock (/tmp/sessiond-UID/... without it).
Shared by the daemon and every client.

The rule is written once, as text (`default_socket_text`): sessionctl's
one-shot path (supervisor.ctl_fast) must not import pathlib, which costs
more at start-up (~5-20 ms here) than that whole path's own work."""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["default_socket_path", "default_socket_text"]


def default_socket_text() -> str:
    env = os.environ.get("SESSIOND_SOCKET")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/sessiond/sessiond.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sessiond-{os.getuid()}"
    return f"{runtime}/sessiond/sessiond.sock"


def default_socket_path() -> Path:
    from pathlib import Path

    return Path(default_socket_text())
