"""Errors of the contract every process shares: the wire layer, and what a
person types that sessionctl and the daemon check alike (ipc/inputs.py).

    ProtocolError               the peer sent something we cannot accept
    ├── FrameTooLarge           length prefix over max_frame_bytes (connection is closed)
    ├── FrameTimeout            a frame begun but not finished in time (connection is closed)
    ├── OverBudget              connections sharing a budget hold too many bytes (connection is closed)
    └── BadMessage              a whole frame that is not a valid message (connection survives)
    ConnectionClosed            the peer went away (EOF or reset); nothing more will arrive
    ValueError
    └── BadOverride             a --set item that is not KEY=VALUE (sessionctl prints it; the
                                daemon's config turns it into its ConfigError)
    Exception
    └── UnsupportedField        a message field the one-shot path's table cannot describe
                                (python -m ipc.wiregen refuses to write the table)

Each side's own errors are in its tree: supervisor/errors.py (the daemon),
supervisor/ctl/errors.py (sessionctl and the client library),
session_worker/errors.py (the zygote, the workers, the tool host's client).
"""

from __future__ import annotations

__all__ = [
    "BadMessage", "BadOverride", "ConnectionClosed", "FrameTimeout", "FrameTooLarge", "OverBudget", "ProtocolError",
    "UnsupportedField",
]


class ProtocolError(Exception):
    pass


class FrameTooLarge(ProtocolError):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class FrameTimeout(ProtocolError):
    def __init__(self, buffered: int, timeout: float) -> None:
        super().__init__(
            f"a frame was still incomplete {timeout:g}s after it began ({buffered} bytes received)"
        )
        self.buffered = buffered
        self.timeout = timeout


class OverBudget(ProtocolError):
    def __init__(self, held: int, limit: int) -> None:
        super().__init__(f"{held} bytes of partly received frames and unsent replies are held "
                         f"over connections that may hold {limit} together")
        self.held = held
        self.limit = limit


class BadMessage(ProtocolError):
    pass


class ConnectionClosed(Exception):
    pass


class BadOverride(ValueError):
    """A `--set` item that is not KEY=VALUE (the daemon's config turns it
    into its ConfigError)."""


class UnsupportedField(Exception):
    """A field the one-shot path's grammar has no kind for (ipc/wiregen.py)."""
