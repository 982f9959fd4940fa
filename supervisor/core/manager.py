"""The daemon's core: the sessions it holds and what clients may do to them.

Runs in the daemon's event loop, single-threaded.  `SessionManager` is the
registry (ids, ownership, quotas, lookups) and the place where a client's
request becomes work for the parts that own each concern:

    EventLog     (events.py)     states, seq numbers, retention, fan-out
    TurnLedger   (ledger.py)     inputs and commits: the durability promises (resumable.py: steps, resume)
    WorkerOwner  (workers.py)    spawn, boot, kills, exits, restarts (turnmessages.py: what a turn says)
    Sweeper      (sweep.py)      memory caps, disk quotas, heartbeats, idleness (turntimer.py: turn timeouts)
    Intake       (intake.py)     sessions in and out: created, restored, damaged, forgotten
    session_info (info.py)       what a client is told about a session
    Subagents    (subagents.py)  spawn_agent as child sessions
    Workspaces   (workspaces.py) who workers run as, and their workspaces
    Damage       (damage.py)     a log a read finds damaged while the daemon runs; repair

`supervisor.core.session` says which part may change which field of a session. Transitions
come from `supervisor.core.states`, limits from `supervisor.core.limits` (pure); state goes through the store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ipc import messages as m
from ipc.contract import ExitReason
from ipc.pacing import Pacer
from supervisor.spawn.cgroups import Cgroups
from supervisor.config import Config
from supervisor.errors import Conflict, NotFound, SessiondError
from supervisor.core.budgets import Budgets
from supervisor.core.damage import Damage
from supervisor.core.events import EventLog
from supervisor.core.ledger import TurnLedger
from supervisor.core.holding import Holding, Holds
from supervisor.core.info import host_confinement, session_info
from supervisor.core.imports import Imported
from supervisor.core.intake import Intake
from supervisor.host.proctable import ProcTable, RemoteFigures
from supervisor.logtag import tagged
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.registry import Registry
from supervisor.core.tracer import NO_TRACER, Tracer, TurnTrace
from supervisor.spawn.seams import Spawner
from supervisor.core.session import Session, Subscriber, damaged_hint
from supervisor.core.slots import LiveSlots
from supervisor.core.states import LIVE, State, Trigger
from supervisor.store.state_store import (
    LoadedSession, RepairResult, SessionLog, StateStore,
)
from supervisor.store.filestore import FileStateStore
from supervisor.core.subagents import Subagents
from supervisor.core.sweep import Sweeper
from supervisor.core.turntimer import TurnTimer
from supervisor.core.turnmessages import TurnMessages
from supervisor.core.exits import describe_exit
from supervisor.core.workers import WorkerOwner
from supervisor.core.workspaces import Workspaces
from supervisor.core.admission import Admission, Identities, SessionUids
from supervisor.core.fdbudget import FdBudget

__all__ = ["SessionManager"]

log = logging.getLogger("sessiond.manager")


class SessionManager:
    def __init__(
        self,
        config: Config,
        state_dir: Path,
        spawner: Spawner,
        *,
        identities: Identities = Identities(),
        store: StateStore | None = None,
        sandbox: m.SandboxBoot | None = None,
        cgroups: Cgroups | None = None,
        cgroups_why: str = "not probed",
        metrics: Recorder = NO_METRICS,
        holds: Holds | None = None,
        open_stored: Callable[[str], tuple[SessionLog, LoadedSession]] | None = None,
        remote: RemoteFigures | None = None,
        tracer: Tracer = NO_TRACER, fds: FdBudget | None = None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.sessions_dir = state_dir / "sessions"
        self.store: StateStore = store if store is not None else FileStateStore(self.sessions_dir)
        self.spawner = spawner
        # By id, with its counts (supervisor.core.registry); a slot freed
        # wakes the creates waiting for one (LiveSlots, built below).
        self.sessions = Registry(on_slot_freed=lambda: self.slots.slot_freed())
        self.proc_table = ProcTable(remote)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._ping_nonce = 0
        self._cgroups_why = cgroups_why  # why there is no cgroup per session, for stats

        def current() -> Config:
            return self.config

        def closing() -> bool:
            return self._closing

        # Built bottom-up, each part with its collaborators.  The calls that run against that order
        # (the ledger arms and disarms the turn timer and has the workers kill a worker ahead of the
        # disk) go through this manager, to parts it builds after the ledger.
        self.admission = Admission(current, identities)  # the socket's and every re-check's
        self.workspaces = Workspaces(current, state_dir, self.admission)
        self.events = EventLog(lambda: self.config.daemon, self.sessions, tracer)
        self.budgets = Budgets(self.sessions, self.store.spend, metrics)
        self.ledger = TurnLedger(
            self.events,
            on_unsaved=lambda session, worker, why: self.workers.kill(session, worker, ExitReason.CRASHED, why, charged=False),
            on_turn_started=lambda session, turn: self.turn_timer.arm_turn_timer(session, turn),
            on_turn_ended=lambda session: self.turn_timer.disarm_turn(session),
            on_fenced=(lambda session, exc: holds.fenced(self.holding, session, exc)) if holds is not None else None,
            metrics=metrics, tracer=tracer, budgets=self.budgets,
        )
        self.slots = LiveSlots(current, self.sessions, self.is_admin, self.events, self.spawn_task, fds,
                               terminate=lambda session, why, grace: self.workers.terminate(session, why, grace))
        self.subagents = Subagents(self, self.sessions, tracer)
        messages = TurnMessages(self.events, self.ledger, self.ledger.resumable, self.subagents, self.spawn_task, metrics)
        self.workers = WorkerOwner(
            current, spawner, self.events, self.ledger, self.ledger.resumable, messages, self.proc_table,
            self.workspaces, self.spawn_task, closing=closing, make_room=self.slots.make_room, sessions=self.sessions,
            claim=(lambda session: holds.claim(self.holding, session)) if holds is not None else None,
            damaged=lambda session, exc: self.damage.at_boot(session, exc), sandbox=sandbox, cgroups=cgroups, metrics=metrics,
        )
        self.sweeper = Sweeper(current, self.sessions, self.events, self.workers, self.proc_table,
                               self.slots.hibernate_soon, stop=self.stop, workspaces=self.workspaces,
                               closing=closing, metrics=metrics, ahead=self.slots.hibernate_ahead)
        self.turn_timer = TurnTimer(current, self.events, self.workers)
        # Sessions in and out: created, restored, damaged, forgotten; the file store's are read at
        # start without a write, in a thread (supervisor.core.loading).
        files = self.store if isinstance(self.store, FileStateStore) and open_stored is None else None
        self.intake = Intake(current, self.sessions, self.store, self.events, self.ledger, self.ledger.resumable,
                             self.workers, self.workspaces, self.slots, spawner, self.budgets, self.admission,
                             self.spawn_task, state_dir=state_dir,
                             open_stored=open_stored or (files.open_stored if files else self.store.load),
                             closing=closing, remove=self.remove, list_ids=files.listed if files else None,
                             read_stored=files.read_stored if files else None)
        self.damage = Damage(current, self.store, self.events, self.workers, self.intake)
        # What a session held by another daemon may have done to it (supervisor.core.fencing).
        self.holding = Holding(current, self.sessions, self.store, self.events, self.ledger, self.workers,
                               self.workspaces, self.intake.settings_for, self.spawn_task, self.intake.forget)

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def pacer(self) -> Pacer:
        """The data plane's pacer (ipc.pacing), shared with the control socket's clients."""
        return self.ledger.pacer

    # ================================================================ in and out (supervisor.core.intake)

    def load_all(self) -> None:
        """Restore every session on disk now; live ones come back hibernated."""
        self.intake.load_all()

    def start_loading(self) -> int:
        """List the sessions on disk and load them in the background
        (supervisor.core.loading): served meanwhile, each loaded at once
        when a request names it.  Returns how many are listed."""
        return self.intake.start_loading()

    @property
    def loading(self) -> tuple[int, int] | None:
        """(loaded, listed) while the start-up load runs; None once done."""
        return self.intake.loading.progress

    async def loaded(self) -> None:
        """Once every session on disk is loaded."""
        await self.intake.loading.done()

    async def settled(self) -> None:
        """Once every session on disk is loaded, or a moment passed (ls)."""
        await self.intake.loading.settle()

    async def create(self, owner_uid: int, session_id: str | None, handler: str | None, overrides: dict[str, Any],
                     *, parent: Session | None = None) -> Session:
        """A new session, booted: checked, its worker ordered, registered
        and stored, then started; a failure leaves nothing behind."""
        return await self.intake.create(owner_uid, session_id, handler, overrides, parent=parent)

    def restore(self, store: SessionLog, loaded: LoadedSession) -> None:
        """A stored session into the registry (at start, adopted from another daemon)."""
        self.intake.restore(store, loaded)

    async def import_session(self, owner_uid: int, session_id: str | None, doc: Imported,
                             free: Callable[[list[Any]], None]) -> Session:
        """A session from an export (supervisor.core.imports); `free` empties its records off the loop."""
        await self.intake.loading.wait("an import")  # (its id, the per-uid quota: every session counts)
        return await self.intake.import_session(owner_uid, session_id, doc, free)

    # ================================================================ the registry

    def is_admin(self, uid: int) -> bool:
        """Root and [daemon] admin_uids (supervisor.core.admission)."""
        return self.admission.is_admin(uid)

    def get(self, session_id: str, uid: int | None = None) -> Session:
        """The session, if `uid` (None = the daemon itself) may touch it.
        Another user's session is answered exactly as a missing one, so
        that ids cannot be probed.  One on disk not loaded yet is loaded now."""
        self.intake.loading.load_now(session_id)
        session = self.sessions.get(session_id)
        if session is None or (
            uid is not None and session.meta.owner_uid != uid and not self.is_admin(uid)
        ):
            raise NotFound(f"no session {session_id!r}")
        return session

    def visible(self, uid: int) -> list[Session]:
        admin = self.is_admin(uid)
        return [s for s in self.sessions.values() if admin or s.meta.owner_uid == uid]

    def info(self, session: Session, with_rss: bool = True) -> m.SessionInfo:
        return session_info(session, self.workers, self.spawner, self.proc_table, self.budgets, self.ledger, with_rss)

    def host_report(self) -> dict[str, Any]:
        """What this host gives every session, for `stats`: the tools'
        sandbox, the cgroups, the disk quota."""
        return host_confinement(self.config.sandbox, self.workers.sandbox, self.workers.cgroups,
                                self._cgroups_why) | self.workspaces.host_report()

    def session_origins(self) -> tuple[frozenset[int], SessionUids]:
        """What supervisor.api.peer checks a client against: the processes
        sessions descend from (the zygote's pid read now: it may have been
        re-executed; the daemon's own too: nothing it forked is a client, and
        a replaced zygote's orphans are still session processes), and the
        uids sessions run as."""
        roots = frozenset(p for p in (self.spawner.zygote_pid, os.getpid()) if p > 0)
        return roots, self.workspaces.session_uids_here()

    def live_workers(self) -> int:
        return sum(1 for s in self.sessions.live if s.worker is not None)

    def running_turns(self) -> int:
        return sum(1 for s in self.sessions.live if s.current_turn is not None)

    # ================================================================ requests

    async def send(
        self,
        session: Session,
        text: str,
        subscriber: Subscriber | None,
        on_accepted: Callable[[m.Accepted], None] | None = None,
        trace: TurnTrace | None = None,
    ) -> m.Accepted:
        """Start a turn; returns once its input is durable.  `on_accepted`
        is called at that moment, before any later event of the turn
        (`trace`: the input's, supervisor.core.tracer)."""
        if self._closing:
            raise Conflict("the daemon is shutting down; no new turns")
        async with session.locked():
            if session.state is State.HIBERNATED:
                await self.workers.claim(session)  # held elsewhere since? (supervisor.core.fencing)
            if session.state is State.HIBERNATED:
                # Room first, so that "no room" leaves it hibernated.
                await self.slots.make_room(session)
                self.events.set_state(session, Trigger.SPAWN, reason="input")
                try:
                    await self.workers.start(session)
                except SessiondError:
                    if session.is_(State.STARTING):
                        self.events.set_state(session, Trigger.EXIT, reason="boot_failed")
                        self.workers.schedule_restart(session)
                    raise
        if session.state in (State.STARTING, State.RESTARTING, State.CRASHED):
            await self.events.wait_state(
                session, (State.IDLE, State.FAILED, State.STOPPED, State.DELETED, State.RUNNING),
                self.config.daemon.boot_timeout_secs,
            )
        match session.state:
            case State.IDLE:
                pass
            case State.RUNNING | State.INTERRUPTING:
                raise Conflict(f"session {session.id} is busy with turn {session.current_turn}; "
                               "wait for it to end or interrupt it")
            case State.STOPPED | State.STOPPING:
                raise Conflict(f"session {session.id} is stopped; `sessionctl restart {session.id}` starts it")
            case State.DAMAGED:
                raise Conflict(damaged_hint(session))
            case State.FAILED:
                raise Conflict(f"session {session.id} has failed ({describe_exit(session.last_exit)}); "
                               f"`sessionctl restart {session.id}` starts it again")
            case _:
                raise Conflict(f"session {session.id} is {session.state}")
        return await self._begin(session, text, subscriber, on_accepted, trace)

    def send_now(
        self, session: Session, text: str, subscriber: Subscriber, on_accepted: Callable[[m.Accepted], None],
        trace: TurnTrace | None = None,
    ) -> asyncio.Future[m.Accepted] | None:
        """`send` for the one case where it would not wait (not shutting
        down, no lock held, the session idle): the turn begins now, inside
        the caller's slice of the pacer; the future resolves once the input
        is durable.  None: call `send`."""
        if self._closing or session.lock_held or session.state is not State.IDLE:
            return None
        return self._begin(session, text, subscriber, on_accepted, trace)

    def _begin(self, session: Session, text: str, subscriber: Subscriber | None,
               on_accepted: Callable[[m.Accepted], None] | None, trace: TurnTrace | None) -> asyncio.Future[m.Accepted]:
        if subscriber is not None:
            self.events.hold(session, subscriber)  # released once Accepted is written
        return self.ledger.begin(session, text, on_accepted, trace)

    def attach(self, session: Session, subscriber: Subscriber, from_seq: int | None) -> int:
        first = self.ledger.unseen_asks(session, from_seq, self.events.oldest_retained(session))
        return self.events.attach(session, subscriber, from_seq, first)

    def detach(self, subscriber: Subscriber, session: Session | None = None) -> None:
        self.events.detach(subscriber, [session] if session is not None else None)

    def interrupt(self, session: Session) -> None:
        if session.state is State.INTERRUPTING:
            return
        if session.state is not State.RUNNING or session.worker is None:
            raise Conflict(f"session {session.id} has no running turn")
        self.events.set_state(session, Trigger.INTERRUPT, reason="interrupted by a client")
        session.worker.conn.send(m.InterruptTurn(turn=session.current_turn or 0))

    async def stop(self, session: Session, reason: str = "stopped", exit_reason: ExitReason | None = None) -> None:
        if session.state is State.DAMAGED:
            raise Conflict(damaged_hint(session))
        for child_id in self.intake.children(session):
            child = self.sessions.get(child_id)
            if child is not None:
                await self.stop(child, f"parent {session.id} {reason}")
        async with session.locked():
            await self._stop_locked(session, reason, exit_reason)

    async def _stop_locked(self, session: Session, reason: str, exit_reason: ExitReason | None = None) -> None:
        if session.state in (State.STOPPED, State.DELETED, State.DAMAGED):
            return  # (a damaged child of a stopped parent: nothing runs)
        await self.workers.claim(session)  # stopped wherever it runs
        if session.is_(State.STOPPED):  # (it was, there)
            return
        self.workers.cancel_restart(session)
        self.events.set_state(session, Trigger.STOP, reason=reason)
        if exit_reason is not None:
            self.workers.stopping_for(session, exit_reason)
        await self.workers.terminate(session, "stopped", self.config.daemon.stop_grace_secs)
        if exit_reason is not None:
            self.workers.stopped_for(session, exit_reason, reason)
        self.events.set_state(session, Trigger.STOPPED, reason=reason)
        await self.ledger.save_mark(session)

    async def restart(self, session: Session) -> None:
        if session.state is State.DAMAGED:
            raise Conflict(damaged_hint(session))
        async with session.locked():
            await self.workers.claim(session)  # before anything changes here
            if session.state in LIVE:
                await self._stop_locked(session, "restart")
            self.workers.cancel_restart(session)
            await self.slots.make_room(session)
            self.events.set_state(session, Trigger.RESTART, reason="restart requested")
            if session.policy is not None:
                session.policy.reset()
            await self.ledger.save_mark(session)
            try:
                await self.workers.start(session)
            except SessiondError:
                if session.is_(State.STARTING):
                    self.events.set_state(session, Trigger.GIVE_UP, reason="boot_failed")
                    await self.ledger.save_mark(session)
                raise

    async def remove(self, session: Session) -> None:
        for child_id in self.intake.children(session):
            child = self.sessions.get(child_id)
            if child is not None:
                await self.remove(child)
        async with session.locked():
            if session.state is State.DELETED:
                return
            session.removing = True  # durable first: a daemon killed during the rm finishes it at start
            await self.ledger.save_mark(session)
            if session.state in LIVE:
                await self._stop_locked(session, "deleted")
            self.workers.cancel_restart(session)
            self.events.set_state(session, Trigger.DELETE, reason="deleted")
            await self.intake.drop(session)
            if session.meta_lost:
                # Which workspace is its own is unknown; the next start's
                # sweep of orphaned workspaces removes it.
                tagged(log, session.id).info("deleted")
                return
            try:
                await asyncio.to_thread(self.workspaces.remove, session)
            except OSError as exc:
                tagged(log, session.id).error("its workspace could not be removed: %s", exc)
            tagged(log, session.id).info("deleted")

    async def repair(self, session: Session, mode: str) -> tuple[Session, RepairResult]:
        """Rewrite a damaged session's stored state per `mode`, then restore
        it as at start-up (hibernated, or stopped/failed as it was)."""
        return await self.damage.repair(session, mode)

    def ping(self, session: Session, answer: Callable[[SessiondError | None], None]) -> int:
        """Round trip through the worker; `answer` is called with None when
        it replies, or with the error if it dies first.  No timer: a worker
        that stops answering stops its heartbeats too, and the sweep kills
        it, which answers every ping in flight.  Returns the worker's pid."""
        worker = session.worker
        if worker is None or not worker.booted or worker.exited.done():
            raise Conflict(f"session {session.id} has no live worker ({session.state})")
        self._ping_nonce += 1
        session.pings = {**(session.pings or {}), self._ping_nonce: answer}
        worker.conn.send(m.WorkerPing(nonce=self._ping_nonce))
        return worker.pid

    def answer(self, session: Session, request_id: str, allow: bool, uid: int | None = None, client: str = "") -> None:
        """A person's answer (`uid`, `client`: who, for the story)."""
        self.ledger.answer(session, request_id, allow, uid, client)

    # ================================================================ capacity

    async def supervise(self) -> None:
        await self.sweeper.run()

    def spawn_task(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ================================================================ reload and shutdown

    def reload(self, config: Config) -> None:
        """New config (SIGHUP): every session, live ones included, runs
        under it from now on, its own overrides pulled back inside the new
        bounds.  What the daemon enforces (memory caps, heartbeats, turn
        timeouts) applies at once; live workers get their new settings, so
        permission rules and the loop's limits apply at the next tool call."""
        self.config = config
        for session in self.sessions.values():
            old = session.settings
            session.settings = self.intake.settings_for(session.id, session.meta.overrides)
            self.events.resize(session)
            self.workers.reconfigure(session, old)
            if session.worker is not None and not session.worker.exited.done():
                self.turn_timer.retime_turn(session)

    async def shutdown(self, grace: float) -> None:
        """Let running turns finish for up to `grace`, then stop every worker.
        Sessions stay on disk and come back hibernated."""
        self._closing = True  # the workers' restarts and the sweep ask `closing`
        deadline = time.monotonic() + grace
        while self.running_turns() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for session in self.sessions.values():
            self.workers.cancel_restart(session)
        live = [s for s in self.sessions.values() if s.worker is not None]
        await asyncio.gather(
            *(self.workers.terminate(s, "stopped by the daemon's shutdown", self.config.daemon.stop_grace_secs)
              for s in live),
            return_exceptions=True,
        )
        for task in list(self._tasks):
            task.cancel()
        for session in self.sessions.values():
            session.store.close()
        self.store.close()
        self.proc_table.close()
        self.workspaces.close()  # workspace images unmounted (a daemon outside systemd)

