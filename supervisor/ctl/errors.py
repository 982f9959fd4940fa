"""Errors of the client side: the sessionctl process and the Python client
library (supervisor.client), run by the operator's or the application's
process.  Imports nothing (not even msgspec): the one-shot path (fast.py)
raises these too and pays for every import at every start.

    ConnectionError
    └── DaemonUnavailable           the daemon cannot be reached, or it went away (and did
        │                           not come back within the client's reconnect wait)
        └── InputUnacknowledged     it went away after an input was sent, before it said the
                                    input was kept: taken or not, nobody knows (never re-sent)
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

__all__ = ["DaemonUnavailable", "ImportFileError", "InputUnacknowledged", "RequestError", "TurnFailedError",
           "Unsure"]


class DaemonUnavailable(ConnectionError):
    """The daemon cannot be reached, or it went away."""


class InputUnacknowledged(DaemonUnavailable):
    """The daemon went away after an input was sent and before it was
    acknowledged: the input may or may not be durable (an input is kept
    only once acknowledged), so it is never sent again by the client;
    `history` shows whether it was taken."""

    def __init__(self, session: str, why: str) -> None:
        super().__init__(
            f"{why} before sessiond acknowledged the input to {session}: it may or may not have been "
            f"taken, and is not sent again (`sessionctl history {session}` shows whether it was)")
        self.session = session


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
