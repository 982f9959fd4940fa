"""`session=ID` at the start of every daemon log message about one session
(a line reads `sessiond.manager: session=ID ...`: the logger's name first),
and the same as fields for machines.

A worker's messages already start with `session=ID` (session_worker/worker/main.py
tags them with a handler filter); the daemon's own lines about that session
carry the same field, so `journalctl -u sessiond --grep 'session=ID'` finds
both sides. Call sites write `tagged(log, session.id).warning("worker %d
exited", pid)`; the message is otherwise what it was.  The record also
carries `session_id` (and what `tagged` or `event` is given: the session's
uids, the lifecycle event), which ipc.logfields sends as journal
fields (`SESSION_ID`, `SESSION_UID`, `SESSIOND_EVENT`...) or JSON keys.

While a session's turn is traced, its lines also carry the trace's and
the turn span's ids (`TRACE_ID`, `SPAN_ID`), so a log line leads to its
trace and back: from the turn's start until the session is at rest again
(the lines of its end, and of a restart after it, belong to its trace).
The tracer (supervisor.ops.otel) says which sessions' turns are traced
(`traced`, `untraced`); with tracing off the table stays empty and a line
pays one dict lookup.

Runs in the daemon, in whichever part logs about a session.  It sits at the
bottom of supervisor/, beside errors.py, and imports nothing of ours: the
store and the spawner below the core tag their lines with it too.  The
tracer that fills the table (supervisor.ops.otel) calls down into it."""

from __future__ import annotations

import logging

__all__ = ["SessionLogger", "tagged", "trace_of", "traced", "untraced"]

# Session id -> the log fields of its traced turn (trace_id, span_id).
_TRACED: dict[str, dict[str, object]] = {}


def traced(session_id: str, trace_id: str, span_id: str) -> None:
    """The session's turn is traced: its lines name the trace and the turn's
    span (ids in lowercase hex, as W3C traceparent writes them)."""
    _TRACED[session_id] = {"trace_id": trace_id, "span_id": span_id}


def trace_of(session_id: str) -> str | None:
    """The trace the session's lines name now, if any."""
    ids = _TRACED.get(session_id)
    return str(ids["trace_id"]) if ids is not None else None


def untraced(session_id: str, trace_id: str = "") -> None:
    """The session's lines no longer name a trace (with `trace_id`: only if
    they still name that one)."""
    if not trace_id or _TRACED.get(session_id, {}).get("trace_id") == trace_id:
        _TRACED.pop(session_id, None)


class SessionLogger:
    """A logger bound to one session id: each message gets the prefix."""

    __slots__ = ("_extra", "_id", "_log", "_prefix")

    def __init__(self, logger: logging.Logger, session_id: str, extra: dict[str, object] | None = None) -> None:
        self._log = logger
        self._id = session_id
        # The id goes in as text, never as part of the format string: a %
        # in it cannot break the line's formatting.
        self._prefix = "session=" + session_id.replace("%", "%%") + " "
        self._extra = extra if extra is not None else {"session_id": session_id}

    def _emit(self, level: int, msg: str, args: tuple[object, ...], exc_info: bool = False,
              event: dict[str, object] | None = None) -> None:
        if not self._log.isEnabledFor(level):
            return
        extra = self._extra if event is None else {**self._extra, **event}
        ids = _TRACED.get(self._id)
        if ids is not None:
            extra = {**extra, **ids}
        # stacklevel=3: the record names the call site, not this class.
        self._log.log(level, self._prefix + msg, *args, exc_info=exc_info, stacklevel=3, extra=extra)

    def log(self, level: int, msg: str, *args: object) -> None:
        self._emit(level, msg, args)

    def event(self, level: int, event: str, fields: dict[str, object], msg: str, *args: object) -> None:
        """A lifecycle line: `event` (SESSIOND_EVENT) and its own fields
        (`session_state`, `sessiond_limit`) on the record."""
        self._emit(level, msg, args, event={"sessiond_event": event, **fields})

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


def tagged(logger: logging.Logger, session_id: str, *, uid: int | None = None,
           owner_uid: int | None = None) -> SessionLogger:
    """`uid`: the uid the session runs as; `owner_uid`: who created it."""
    extra: dict[str, object] = {"session_id": session_id}
    if uid is not None:
        extra["session_uid"] = uid
    if owner_uid is not None:
        extra["session_owner_uid"] = owner_uid
    return SessionLogger(logger, session_id, extra)
