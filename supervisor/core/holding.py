"""A session another daemon holds: what the core does to let go of it and
to take it back, for supervisor.core.fencing.

Runs in the daemon's loop.  Several daemons may share one store; the store
fences writers (supervisor.store.state_store: `Fenced`).  The cluster side
decides *when* a session is let go of or claimed back (`Holds`, handed to
SessionManager when it is built); the core does the changes here, through
the operations of the parts that own each field (supervisor.core.session's
table): the manager's own fields (`error`, `store`, `meta`, `settings`) are
written here on its behalf, as the table says.

`Holding` is what a `Holds` is given at each call (the manager builds it
with its parts): a `Holds` is built before the manager, so it is handed the
operations it may use rather than holding the manager.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import msgspec

from ipc import messages as m
from ipc.settings import SessionSettings
from supervisor.config import Config
from supervisor.core.events import EventLog
from supervisor.core.ledger import TurnLedger
from supervisor.core.registry import Registry
from supervisor.core.session import Session
from supervisor.core.states import LIVE, State, Trigger
from supervisor.core.workers import WorkerOwner
from supervisor.core.workspaces import Workspaces
from supervisor.logtag import tagged
from supervisor.store.state_store import Fenced, LoadedSession, Meta, SessionLog, StateStore

__all__ = ["Holding", "Holds"]

log = logging.getLogger("sessiond.manager")


class Holds(Protocol):
    """Who holds a session when daemons share a store (supervisor.core.fencing.Fencing)."""

    def fenced(self, ops: Holding, session: Session, exc: Fenced) -> None:
        """The store refused a write for `session`: another daemon took it."""

    async def claim(self, ops: Holding, session: Session) -> None:
        """Take `session` back before a worker starts for it (a no-op if held here)."""


class Holding:
    def __init__(
        self,
        config: Callable[[], Config],
        sessions: Registry,
        store: StateStore,
        events: EventLog,
        ledger: TurnLedger,
        workers: WorkerOwner,
        workspaces: Workspaces,
        settings_for: Callable[[str, dict[str, Any]], SessionSettings],
        spawn_task: Callable[[Coroutine[Any, Any, None]], None],
        forget: Callable[[Session], None],
    ) -> None:
        self._config = config
        self._sessions = sessions
        self.store = store
        self._events = events
        self._ledger = ledger
        self._workers = workers
        self._workspaces = workspaces
        self._settings_for = settings_for
        self.spawn_task = spawn_task
        self._forget = forget

    def note(self, session: Session, reason: str) -> None:
        """Why it is not this daemon's (`error`, shown by status and ls)."""
        session.error = reason

    def stored_problem(self, meta: Meta) -> tuple[str, bool] | None:
        """What is wrong with a stored session's values here (as on create)."""
        return self._workspaces.stored_problem(meta, self._sessions.values())

    async def release(self, session: Session, reason: str, unheld: SessionLog, expected: str) -> None:
        """Let go of it: its worker stopped as `stop` does (its exit recorded
        as `expected`), its log swapped for `unheld` (which writes nothing),
        hibernated here.  Caller holds session.locked()."""
        self._workers.cancel_restart(session)
        session.error = reason
        held, session.store = session.store, unheld
        held.close()
        if session.state in LIVE:
            self._events.set_state(session, Trigger.STOP, reason=reason)
        if session.state is State.STOPPING:
            await self._workers.terminate(session, expected, self._config().daemon.stop_grace_secs)
        if session.state is not State.HIBERNATED:
            self._events.set_state(session, Trigger.RELEASE, reason=reason)

    def removed(self, session: Session, reason: str) -> None:
        """Removed by another daemon (and let go of here): forgotten."""
        if self._sessions.get(session.id) is not session:
            return
        if session.state is not State.DELETED:
            self._events.set_state(session, Trigger.DELETE, reason=reason)
        self._forget(session)

    async def refresh(self, session: Session, held: SessionLog, loaded: LoadedSession) -> None:
        """Claimed back: what the store says of it, over what this daemon
        knew (it may have run elsewhere since).  Caller holds session.locked()."""
        session.store = held
        old, session.meta = session.meta, loaded.meta
        self._sessions.meta_changed(session, old)  # (its owner and run uid, as the registry counts them)
        session.settings = self._settings_for(session.id, loaded.meta.overrides)
        session.error = None
        self._ledger.restore_totals(session, loaded.turns, loaded.usage)
        last = loaded.mark.last_exit
        self._workers.restore_exits(session, loaded.mark.restarts,
                                    msgspec.convert(last, m.ExitInfo) if last else None)
        self._events.raise_seq(session, loaded.seq)  # numbers only go up, for this daemon's clients and the holder's
        self._events.adopt_lifecycle(session, loaded.lifecycle)  # `logs` shows what happened there too
        if loaded.mark.state == "stopped" and session.state is State.HIBERNATED:
            # Stopped where it ran: it stays stopped here until a restart.
            self._events.set_state(session, Trigger.STOP, reason="stopped on another daemon")
            self._events.set_state(session, Trigger.STOPPED, reason="stopped on another daemon")
        if loaded.open_input is not None:
            # Its holder died during this turn (a live one would have refused).
            self._ledger.abort_stored(session, held, loaded.open_input.turn,
                                      "the daemon that held it stopped during this turn", durable=False)
        # The abort and this daemon's mark, by the group commit, off the loop.
        await self._ledger.save_mark(session)
        tagged(log, session.id).info("claimed (generation %d): %d turn(s) so far", held.generation, loaded.turns)
