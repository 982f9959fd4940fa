"""Draining a cluster node before maintenance (`sessionctl drain NODE`).

What an operator expects from `kubectl drain` or `nomad node drain`:

1. The node is marked at once: no new worker is placed there, whoever
   asks (a create, a revive, a restart after a crash).  The mark is the
   spawner's (`supervisor.cluster.ray_spawner`: a label selector on every
   placement, and a flag on the node's host that the other fronts learn).
2. Each session on the node is moved as soon as it is idle; a running turn
   finishes first.  A move is make-before-break: a worker is placed on
   another node first, and only once it exists is the old one stopped (the
   session hibernates: its state is in the store) and the new one booted
   from the stored state.  A session for which no other node has a free
   slot stays where it runs, and the reply says so.
3. The drain ends when the node has no session left, when its time runs
   out (`--timeout`; by default as long as a turn may run, plus a margin
   for the moves, so that every turn running when it began has ended), or
   when it is undone.  The reply lists what moved, where, and what was
   left and why.  The node stays marked until `sessionctl drain --undo
   NODE`; running the drain again continues it.

A drain runs in a task of its own: a client that goes away does not stop
it half-way through a move, and a second request for the same node while
it runs gets its result.

Runs in the daemon's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from ipc import operator as op
from supervisor.errors import Conflict, NotFound, SessiondError
from supervisor.cluster.ray_spawner import RaySpawner
from supervisor.spawn.seams import Spawner, SpawnerDied, drop_pending
from supervisor.core.drainreq import check
from supervisor.core.events import EventLog
from supervisor.core.session import Session
from supervisor.core.workers import WorkerOwner
from supervisor.core.states import State, Trigger

if TYPE_CHECKING:
    from supervisor.core.manager import SessionManager

__all__ = ["DEFAULT_MARGIN_SECS", "Drainer"]

log = logging.getLogger("sessiond.drain")

# Added to the longest a turn may run ([agent] turn_timeout_secs) for the
# default --timeout: time for the moves themselves.
DEFAULT_MARGIN_SECS = 60.0
# How often a drain looks for sessions that came to the node meanwhile
# (a worker placed there just before the mark).
_LOOK_SECS = 0.25


class Drainer:
    """The drains of one daemon, one task per node at a time.  Built by the
    daemon (supervisor.daemon._build) with the parts a move uses; the control
    server is handed `handle`."""

    def __init__(self, manager: SessionManager, spawner: RaySpawner, events: EventLog, workers: WorkerOwner) -> None:
        self._manager = manager
        self._ray = spawner
        self._events = events
        self._workers = workers
        self._running: dict[str, asyncio.Task[op.DrainReply]] = {}  # node id -> its drain
        self._stops: dict[str, asyncio.Event] = {}  # node id -> set by an undo

    async def handle(self, msg: op.Drain, uid: int) -> op.DrainReply:
        """The `Drain` request (server dispatch): checked (supervisor.core.drainreq), then done."""
        node, timeout = check(self._manager.is_admin, msg, uid)
        reply = await (self.undo(node) if msg.undo else self.drain(node, timeout))
        reply.id = msg.id
        return reply

    async def _find(self, node: str, alive: bool) -> tuple[str, str]:
        try:
            return await self._ray.find_node(node, alive)
        except LookupError as exc:
            raise NotFound(str(exc)) from None

    async def drain(self, node: str, timeout: float | None) -> op.DrainReply:
        node_id, ip = await self._find(node, alive=True)
        if timeout is None:
            timeout = self._manager.config.agent.turn_timeout_secs + DEFAULT_MARGIN_SECS
        task = self._running.get(node_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._drain(node_id, ip, timeout))
            self._running[node_id] = task
            task.add_done_callback(lambda _: self._running.pop(node_id, None))
        reply = await asyncio.shield(task)  # a client that leaves does not stop it
        return op.DrainReply(id=0, node=reply.node, node_id=reply.node_id, draining=reply.draining,
                             moved=reply.moved, left=reply.left, elapsed_secs=reply.elapsed_secs)

    async def undo(self, node: str) -> op.DrainReply:
        node_id, ip = await self._find(node, alive=False)
        stop = self._stops.get(node_id)
        if stop is not None:
            stop.set()  # a drain running now ends, reporting what it left
        try:
            await self._find(node_id, alive=True)
            alive = True
        except NotFound:
            alive = False  # its mark goes from this front; no host is left to tell
        await self._ray.mark_draining(node_id, ip, False, alive=alive)
        return op.DrainReply(id=0, node=ip, node_id=node_id, draining=False)

    def _on(self, node_id: str) -> list[Session]:
        """The sessions whose worker runs on the node now."""
        return [s for s in self._manager.sessions.values()
                if s.worker is not None and self._ray.node_of(s.worker.pid) == node_id]

    async def _drain(self, node_id: str, ip: str, timeout: float) -> op.DrainReply:
        loop = asyncio.get_running_loop()
        began = loop.time()
        stop = self._stops.setdefault(node_id, asyncio.Event())
        stop.clear()
        await self._ray.mark_draining(node_id, ip, True)
        deadline_handle = loop.call_at(began + timeout, stop.set)
        moved: list[op.DrainMoved] = []
        failed: dict[str, str] = {}  # session -> why its move failed (not tried again)
        moves: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                here = [s for s in self._on(node_id) if s.id not in failed]
                for session in here:
                    if session.id not in moves or moves[session.id].done():
                        moves[session.id] = loop.create_task(
                            self._move(session, node_id, ip, stop, moved, failed))
                busy = [t for t in moves.values() if not t.done()]
                if node_id not in self._ray.draining:
                    stop.set()  # undone meanwhile, by another front (its host no longer holds the mark)
                if (not here and not busy) or stop.is_set():
                    break
                if busy:
                    await asyncio.wait(busy, timeout=_LOOK_SECS, return_when=asyncio.FIRST_COMPLETED)
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), _LOOK_SECS)
            # A move under way ends by itself (its wait stops with `stop`,
            # and a move that began is finished, never cut half-way).
            for sid, outcome in zip(moves, await asyncio.gather(*moves.values(), return_exceptions=True)):
                if isinstance(outcome, Exception):
                    log.error("drain of %s: moving session=%s failed", ip, sid, exc_info=outcome)
                    failed.setdefault(sid, f"internal error: {outcome}")
        finally:
            deadline_handle.cancel()
            if self._stops.get(node_id) is stop:
                del self._stops[node_id]
        undone = node_id not in self._ray.draining
        left = []
        for session in self._on(node_id):
            if session.id in failed:
                why = failed[session.id]
            elif undone:
                why = "the drain was undone"
            elif session.state in (State.RUNNING, State.INTERRUPTING):
                why = f"turn {session.current_turn} still running after {timeout:g}s"
            else:
                why = f"still {session.state} after {timeout:g}s"
            left.append(op.DrainLeft(session=session.id, state=str(session.state), reason=why))
        return op.DrainReply(id=0, node=ip, node_id=node_id, draining=not undone, moved=moved, left=left,
                             elapsed_secs=round(loop.time() - began, 3))

    async def _move(self, session: Session, node_id: str, ip: str, stop: asyncio.Event,
                    moved: list[op.DrainMoved], failed: dict[str, str]) -> None:
        """Move one session off the node once it is idle (until `stop`)."""
        grace = self._manager.config.daemon.stop_grace_secs
        while not stop.is_set():
            if session.lock_held or not self._movable(session, node_id):
                if session.worker is None or self._ray.node_of(session.worker.pid) != node_id:
                    return  # it left the node by itself (stopped, crashed and restarted elsewhere)
                await _state_change(session, stop)
                continue
            # A worker elsewhere first: the node is marked, so Ray places it on another.
            pending = self._ray.request()
            try:
                await asyncio.shield(pending)
            except SpawnerDied as exc:
                failed[session.id] = f"no other node took it: {exc}"
                return
            async with session.locked():
                if not self._movable(session, node_id):
                    drop_pending(self._workers.spawner, pending)  # a turn began meanwhile: wait again
                    continue
                self._events.set_state(session, Trigger.HIBERNATE, reason=f"drain: moving off {ip}")
                await self._workers.terminate(session, "hibernated", grace)
                self._events.set_state(session, Trigger.SPAWN, reason=f"drain: moved off {ip}")
                try:
                    await self._workers.start(session, pending)
                except SessiondError as exc:
                    # As a failed revive: restarted with backoff, elsewhere.
                    if session.is_(State.STARTING):
                        self._events.set_state(session, Trigger.EXIT, reason="boot_failed")
                        self._workers.schedule_restart(session)
                    failed[session.id] = f"its worker on the new node did not boot: {exc.message}"
                    return
            worker = session.worker
            where = self._ray.placement(worker.pid)[1] if worker is not None else None
            moved.append(op.DrainMoved(session=session.id, node=where or ""))
            return

    def _movable(self, session: Session, node_id: str) -> bool:
        return (session.state is State.IDLE and session.worker is not None
                and self._ray.node_of(session.worker.pid) == node_id)


async def _state_change(session: Session, stop: asyncio.Event) -> None:
    """Until the session's state changes or `stop` is set (or a short while
    passes: the session's lock is not an event)."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    session.state_waiters = [*(session.state_waiters or ()), fut]
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([fut, stopped], timeout=_LOOK_SECS, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not fut.done():
            fut.cancel()
