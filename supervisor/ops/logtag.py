"""`session=ID` at the start of every daemon log message about one session
(a line reads `sessiond.manager: session=ID ...`: the logger's name first).

A worker's messages already start with `session=ID` (session_worker/main.py
tags them with a handler filter); the daemon's own lines about that session
carry the same field, so `journalctl -u sessiond --grep 'session=ID'` finds
both sides. Call sites write `tagged(log, session.id).warning("worker %d
exited", pid)`; the message is otherwise what it was."""

from __future__ import annotations

import logging

__all__ = ["SessionLogger", "tagged"]


class SessionLogger:
    """A logger bound to one session id: each message gets the prefix."""

    __slots__ = ("_log", "_prefix")

    def __init__(self, logger: logging.Logger, session_id: str) -> None:
        self._log = logger
        # The id goes in as text, never as part of the format string: a %
        # in it cannot break the line's formatting.
        self._prefix = "session=" + session_id.replace("%", "%%") + " "

    def _emit(self, level: int, msg: str, args: tuple[object, ...], exc_info: bool = False) -> None:
        # stacklevel=3: the record names the call site, not this class.
        self._log.log(level, self._prefix + msg, *args, exc_info=exc_info, stacklevel=3)

    def log(self, level: int, msg: str, *args: object) -> None:
        self._emit(level, msg, args)

    def debug(self, msg: str, *args: object) -> None:
        self._emit(logging.DEBUG, msg, args)

    def info(self, msg: str, *args: object) -> None:
        self._emit(logging.INFO, msg, args)

    def warning(self, msg: str, *args: object) -> None:
        self._emit(logging.WARNING, msg, args)

    def error(self, msg: str, *args: object) -> None:
        self._emit(logging.ERROR, msg, args)

    def exception(self, msg: str, *args: object) -> None:
        self._emit(logging.ERROR, msg, args, exc_info=True)


def tagged(logger: logging.Logger, session_id: str) -> SessionLogger:
    return SessionLogger(logger, session_id)
