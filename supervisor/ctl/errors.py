"""Errors of the client side: the sessionctl process and the Python client
library (supervisor.client), run by the operator's or the application's
process.  Imports nothing (not even msgspec): the one-shot path (fast.py)
raises these too and pays for every import at every start.

    ConnectionError
    └── DaemonUnavailable           the daemon cannot be reached, or it went away
    RequestError(code, message)     the daemon answered a request with an ipc Error
    TurnFailedError(event)          a turn the client waited for failed (its TurnFailed)
    ImportFileError                 sessionctl import: the file named cannot be read (usage)
    Unsure                          fast.py: something the one-shot path does not vouch
                                    for; the full path takes over (never leaves fast.py)

The public names are also importable from supervisor.client and
supervisor.ctl.client, where applications have always found them.  Errors
of the wire itself (a frame too large, a closed connection) are ipc/errors.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipc.messages import TurnFailed

__all__ = ["DaemonUnavailable", "ImportFileError", "RequestError", "TurnFailedError", "Unsure"]


class DaemonUnavailable(ConnectionError):
    """The daemon cannot be reached, or it went away."""


class RequestError(Exception):
    """The daemon answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TurnFailedError(Exception):
    """A turn the client waited for failed; `event` is its TurnFailed."""

    def __init__(self, event: TurnFailed) -> None:
        super().__init__(event.reason)
        self.event = event


class ImportFileError(Exception):
    """The file named on the command line cannot be read (a usage error)."""


class Unsure(Exception):
    """Something the one-shot path (fast.py) does not vouch for: the full
    path takes over."""
