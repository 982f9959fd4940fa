"""What names a worker: `session=ID` on every line it logs (with the
session's uid, and the trace of the turn under way), and a process title
that does not (other users see every process's title, docs/security.md)."""

from __future__ import annotations

import logging
import os

import setproctitle

from session_worker import tracing

__all__ = ["SessionTag", "name_process"]


class SessionTag(logging.Filter):
    """Puts `session=ID` at the start of every line this worker logs.

    A filter on the handlers, not a format: the worker keeps the handler it
    inherited from the daemon through the zygote (journal priorities or
    timestamps, as the daemon chose) and only adds the field, whichever
    logger the record comes from (ours, asyncio, a handler's own)."""

    def __init__(self, session: str) -> None:
        super().__init__()
        self.session = session
        self.prefix = f"session={session} "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "session_tagged", False):
            record.msg = self.prefix + str(record.msg)
            record.session_tagged = True
            # As fields too (journald's SESSION_ID, SESSION_UID; the JSON
            # lines' keys): the uid is read here, as confinement changes it.
            record.session_id = self.session
            record.session_uid = os.getuid()
            # A line written during a traced turn names its trace (and the
            # span open then), as the daemon's lines about it do.
            ids = tracing.log_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


def name_process(session: str) -> None:
    """The log lines carry the id; `ps` shows `sessiond: worker (booted)`,
    not the id: other users see every process's title (docs/security.md)."""
    setproctitle.setproctitle("sessiond: worker (booted)")
    tag = SessionTag(session)
    for handler in logging.getLogger().handlers:
        handler.addFilter(tag)
