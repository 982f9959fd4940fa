"""Sub-agents: a worker's `spawn_agent`, run as a child session.

Runs in the daemon's loop.  The daemon, not the worker, creates and
supervises the child (its own worker, limits, restarts), gives it the
parent's overrides held to today's ceilings, runs the task as its first
turn and hands the reply back.  The child's handler is the one asked for,
else the parent's own; only "agent", "echo", the parent's handler and
`[agent.subagents] allowed_handlers` may be asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ipc import messages as m
from supervisor.errors import BadRequest, Conflict, Internal, LimitError, SessiondError
from supervisor.logtag import tagged
from supervisor.core.tracer import NO_TRACER, SubagentTrace, Tracer, TurnTrace
from supervisor.core.session import Session, Subscriber, WorkerProc

__all__ = ["SessionHost", "Subagents", "child_prefix"]


class SessionHost(Protocol):
    """What running a child needs of the daemon's core (SessionManager)."""

    async def create(
        self, owner_uid: int, session_id: str | None, handler: str | None,
        overrides: dict[str, Any], *, parent: Session | None = None,
    ) -> Session: ...

    async def send(
        self, session: Session, text: str, subscriber: Subscriber | None,
        on_accepted: Callable[[m.Accepted], None] | None = None, trace: TurnTrace | None = None,
    ) -> m.Accepted: ...

    def interrupt(self, session: Session) -> None: ...

log = logging.getLogger("sessiond.manager")


def child_prefix(parent_id: str) -> str:
    """How every child's id starts: the parent's id cut from the right so
    that the child's (this, then 6 hex digits) stays a valid one (<= 64).
    The start-up load finds a parent's children by it before they are
    loaded (supervisor.core.loading)."""
    return f"{parent_id[:57]}."


class Subagents:
    def __init__(self, manager: SessionHost, sessions: Mapping[str, Session], tracer: Tracer = NO_TRACER) -> None:
        self._manager = manager
        self._sessions = sessions
        self._tracer = tracer

    async def run(self, parent: Session, worker: WorkerProc, msg: m.SpawnAgent) -> None:
        """Answer the worker's SpawnAgent with the child's reply or why not."""
        # Its span, under the worker's spawn_agent call, when the turn is traced.
        traced = self._tracer.subagent(parent.trace, msg.span, msg.handler or parent.meta.handler)
        try:
            reply = await self._reply(parent, msg, traced)
            result = m.SpawnResult(request_id=msg.request_id, ok=True, reply=reply)
        except SessiondError as exc:
            result = m.SpawnResult(request_id=msg.request_id, ok=False, reason=exc.message)
        except Exception as exc:  # never let one spawn take the daemon down
            tagged(log, parent.id).exception("sub-agent failed")
            result = m.SpawnResult(request_id=msg.request_id, ok=False, reason=f"internal error: {exc}")
        if traced is not None:
            traced.end(result.reason)
        if parent.worker is worker:
            worker.conn.send(result)

    def _root(self, session: Session) -> Session:
        while session.meta.parent and session.meta.parent in self._sessions:
            session = self._sessions[session.meta.parent]
        return session

    def _child_id(self, parent: Session) -> str:
        """PARENT.XXXXXX (child_prefix)."""
        for _ in range(16):
            child_id = f"{child_prefix(parent.id)}{secrets.token_hex(3)}"
            if child_id not in self._sessions:
                return child_id
        raise Conflict(f"no free id for a sub-agent of {parent.id}")

    async def _reply(self, parent: Session, msg: m.SpawnAgent, traced: SubagentTrace | None = None) -> str:
        limits = parent.settings.agent.subagents
        if parent.meta.depth + 1 > limits.max_depth:
            raise LimitError(f"sub-agent refused: max_depth {limits.max_depth} reached")
        root = self._root(parent)
        if root.spawned >= limits.max_total_spawns:
            raise LimitError(f"sub-agent refused: max_total_spawns {limits.max_total_spawns} reached")
        running = sum(
            1 for cid in parent.children
            if (c := self._sessions.get(cid)) is not None and c.current_turn is not None
        )
        if running >= limits.max_concurrent:
            raise LimitError(f"sub-agent refused: max_concurrent {limits.max_concurrent} children already running")
        handler = msg.handler or parent.meta.handler
        allowed = {"agent", "echo", parent.meta.handler, *limits.allowed_handlers}
        if handler not in allowed:
            raise BadRequest(
                f"sub-agent refused: handler {handler!r} is not allowed "
                "([agent.subagents] allowed_handlers)"
            )
        root.spawned += 1
        asked = time.time_ns()  # the child's queue span counts its creation and boot
        child = await self._manager.create(
            parent.meta.owner_uid, self._child_id(parent), handler,
            dict(parent.meta.overrides), parent=parent,
        )
        fut: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

        def register(accepted: m.Accepted) -> None:
            # Called as the input becomes durable, which always precedes the
            # turn's end (a quick child may be done before send() returns).
            child.turn_results = {**(child.turn_results or {}), accepted.turn: fut}

        trace = None
        if traced is not None:
            traced.child(child.id)
            trace = traced.turn(asked)
        await self._manager.send(child, msg.task, None, register, trace)
        try:
            ok, text = await asyncio.wait_for(asyncio.shield(fut), limits.child_timeout_secs)
        except asyncio.TimeoutError:
            with contextlib.suppress(SessiondError):
                self._manager.interrupt(child)
            raise LimitError(
                f"sub-agent {child.id} did not finish within child_timeout_secs={limits.child_timeout_secs:g}"
            ) from None
        if not ok:
            raise Internal(f"sub-agent {child.id} failed: {text}")
        return text
