"""Permission requests that wait on a person (the agent's `ask` rules, any
handler's `ctx.ask_permission`): which are pending, since when, and who
answered them.

Runs in the daemon's loop, as a part of the `TurnLedger`, which builds it
and through it owns `Session.pending_asks`.  A request nobody sees is an
agent that looks hung, so a pending one is shown everywhere a session is:
`SessionInfo.waiting` (`ls`, `status`, `top`, the console's list), the
metrics, and again to every client that attaches (`unseen`), not only to
those attached when it came.

A request and its answer are each an event and a record: the request a
`PermissionRequest` and an `Asked`; the answer goes to the worker, and is a
`Notice{kind="permission_answered"}` (allowed or not, the answering
connection's uid and client name, the time) and an `Answered`, so that
`history` and the console tell the same story after a reload or a daemon
restart as they did live (supervisor/api/story.py reads them back).

The worker is untrusted here as anywhere: a request whose id or tool name
is out of bounds, that repeats a pending id, or past `MAX_PENDING` at once
is denied on the spot (the handler hears no, nobody is asked).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from ipc import messages as m
from ipc.contract import PERMISSION_ANSWERED
from supervisor.core.events import EventLog
from supervisor.core.session import PendingAsk, Session
from supervisor.errors import NotFound
from supervisor.logtag import tagged
from supervisor.store.state_store import Answered, Asked, Record, StoreError

__all__ = ["Asks", "MAX_PENDING"]

log = logging.getLogger("sessiond.manager")

# Requests of one session pending at once (a turn's parallel tool calls
# each ask at most once).
MAX_PENDING = 64
_MAX_ID_CHARS = 200
_MAX_TOOL_CHARS = 256


class Asks:
    def __init__(self, events: EventLog) -> None:
        self._events = events

    def asked(self, session: Session, msg: m.AskPermission) -> None:
        """The running turn asks: a person must answer (`answer`)."""
        worker = session.worker
        rid = msg.request_id
        pending = session.pending_asks or {}
        if (not 0 < len(rid) <= _MAX_ID_CHARS or len(msg.tool) > _MAX_TOOL_CHARS or rid in pending
                or len(pending) >= MAX_PENDING):
            tagged(log, session.id).warning("permission request %.60r for %.60r denied unasked: out of bounds, "
                                            "a repeat, or over %d pending", rid, msg.tool, MAX_PENDING)
            if worker is not None:
                worker.conn.send(m.PermissionAnswer(request_id=rid, allow=False))
            return
        request = m.PermissionRequest(session=session.id, seq=self._events.next_seq(session), turn=msg.turn,
                                      request_id=rid, tool=msg.tool, arguments=msg.arguments)
        at = time.time()
        session.pending_asks = {**pending, rid: PendingAsk(request, at)}  # (a few at most: copied)
        _keep(session, Asked(turn=msg.turn, request_id=rid, tool=msg.tool, arguments=msg.arguments, at=at))
        self._events.emit(session, request)

    def answer(self, session: Session, request_id: str, allow: bool, uid: int | None, client: str) -> None:
        """A person's answer, from the connection of `uid` (its `Hello`
        named it `client`)."""
        worker = session.worker
        asks = session.pending_asks or {}
        pending = asks.get(request_id)
        if worker is None or pending is None:
            waiting = ", ".join(asks) or "none"
            raise NotFound(f"session {session.id} has no pending permission request {request_id!r} "
                           f"(pending: {waiting})")
        session.pending_asks = {rid: p for rid, p in asks.items() if rid != request_id} or None
        worker.conn.send(m.PermissionAnswer(request_id=request_id, allow=allow))
        at = time.time()
        turn = pending.request.turn
        _keep(session, Answered(turn=turn, request_id=request_id, allowed=allow, at=at, uid=uid, client=client))
        self._events.emit(session, m.Notice(
            session=session.id, seq=self._events.next_seq(session), turn=turn, kind=PERMISSION_ANSWERED,
            data={"request_id": request_id, "tool": pending.request.tool, "allowed": allow, "uid": uid,
                  "client": client, "at": at}))

    @staticmethod
    def drop(session: Session) -> None:
        """Its turn ended, or its worker died: nothing is asked any more
        (a resumed turn asks again)."""
        session.pending_asks = None

    @staticmethod
    def waiting(session: Session) -> list[m.Waiting]:
        return [m.Waiting(request_id=rid, tool=p.request.tool, since=p.since, turn=p.request.turn,
                          seq=p.request.seq) for rid, p in (session.pending_asks or {}).items()]

    @staticmethod
    def unseen(session: Session, from_seq: int | None, oldest: int) -> Iterable[m.PermissionRequest]:
        """The pending requests a client attaching now would not get from
        the replay (`from_seq`; None: live only) of what is retained (from
        `oldest` on): sent to it first."""
        for pending in (session.pending_asks or {}).values():
            seq = pending.request.seq
            if from_seq is None or from_seq <= seq < oldest:
                yield pending.request


def _keep(session: Session, record: Record) -> None:
    """For `history`, flushed by the group commit; a log that refuses it
    (damaged, held by another daemon) costs only the story."""
    try:
        session.store.append(record, durable=False)
        session.store.sync_soon().add_done_callback(_retrieve)
    except StoreError as exc:
        tagged(log, session.id).warning("permission request not kept for history: %s", exc)


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()  # a failed flush is the next commit's to report
