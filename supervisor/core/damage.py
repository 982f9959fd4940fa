"""A session whose stored log turns out damaged while the daemon runs.

Runs in the daemon's loop.  The start-up load refuses a damaged log
(`StoreDamaged`: damage followed by intact records, or records a damaged
journal lost) and lists the session as `damaged`.  Every later read of the
log makes the same check (supervisor.store: a worker's boot, a revival,
`history`, `export`), and what it finds is handled here, at once: the
session becomes `damaged` with the reason, its files are kept as they are,
its log is swapped for one that refuses every write (`DamagedLog`), and a
worker it still has is stopped, so that nothing is written after the
damage until the operator's `repair` (or `rm`).  A read that went on past
the damage would hand a worker a history with a hole in it, and the next
turn would be written after the hole, unseen until the next start.

`repair` rewrites a damaged session's stored state (the store's `repair`)
and restores it as the start-up load does (supervisor.core.intake).

The manager's fields (`store`, `error`) are written here on its behalf,
as supervisor.core.session's table says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from supervisor.config import Config
from supervisor.core.events import EventLog
from supervisor.core.intake import Intake
from supervisor.core.ledger import store_failure
from supervisor.core.session import Session, damaged_hint
from supervisor.core.states import State, Trigger
from supervisor.core.workers import WorkerOwner
from supervisor.errors import BadRequest, Conflict, Internal, StoreDamaged, StoreError
from supervisor.logtag import tagged
from supervisor.store.state_store import DamagedLog, RepairMode, RepairResult, StateStore

__all__ = ["Damage"]

log = logging.getLogger("sessiond.manager")

# What a worker stopped for it is told, and what its running turn fails with
# ("the session was ..."): ledger.abort words it.
_STOPPED = "stopped: its stored log is damaged"


class Damage:
    def __init__(self, config: Callable[[], Config], store: StateStore, events: EventLog,
                 workers: WorkerOwner, intake: Intake) -> None:
        self._config = config
        self._store = store
        self._events = events
        self._workers = workers
        self._intake = intake

    def at_boot(self, session: Session, exc: StoreDamaged) -> Conflict:
        """A worker's boot read found damage (a revival, a restart): no
        worker runs yet; the session is `damaged` now.  Returns the error
        for the caller to raise."""
        self._refuse_writes(session, exc)
        if session.state not in (State.DAMAGED, State.DELETED):
            self._events.set_state(session, Trigger.DAMAGE, reason=exc.reason)
        return Conflict(damaged_hint(session))

    async def found(self, session: Session, exc: StoreDamaged) -> Conflict:
        """A read outside a boot (history, export) found damage: writes are
        refused at once; the worker, if any, is stopped as `stop` stops it
        (its running turn fails); then the session is `damaged`.  Returns
        the error for the caller to raise."""
        self._refuse_writes(session, exc)
        async with session.locked():
            if session.state in (State.DAMAGED, State.DELETED):
                return Conflict(damaged_hint(session))
            self._workers.cancel_restart(session)
            if session.worker is not None:
                await self._workers.terminate(session, _STOPPED, self._config().daemon.stop_grace_secs)
            if session.state not in (State.DAMAGED, State.DELETED):
                self._events.set_state(session, Trigger.DAMAGE, reason=exc.reason)
        return Conflict(damaged_hint(session))

    def _refuse_writes(self, session: Session, exc: StoreDamaged) -> None:
        if isinstance(session.store, DamagedLog):
            return
        tagged(log, session.id).error("is damaged: %s; nothing more is written to it until "
                                      "`sessionctl repair` (or `rm`)", exc.reason)
        session.error = exc.reason
        held, session.store = session.store, DamagedLog(self._store, session.id, exc.reason)
        held.close()

    async def repair(self, session: Session, mode: str) -> tuple[Session, RepairResult]:
        """Rewrite a damaged session's stored state per `mode`, then restore
        it as at start-up (hibernated, or stopped/failed as it was)."""
        try:
            how = RepairMode(mode)
        except ValueError as exc:
            raise BadRequest(f"unknown repair mode {mode!r}: use skip_bad or truncate") from exc
        async with session.locked():
            if session.state is not State.DAMAGED:
                raise Conflict(f"session {session.id} is {session.state}, not damaged; nothing to repair")
            try:
                result = self._store.repair(session.id, how)
                store, loaded = self._store.load(session.id)
            except StoreDamaged as exc:
                session.error = exc.reason
                raise Conflict(f"session {session.id} cannot be repaired: {exc.reason}") from None
            except StoreError as exc:
                raise store_failure(f"session {session.id} could not be repaired: ", exc) from None
            except OSError as exc:
                raise Internal(f"session {session.id} could not be repaired: {exc}") from exc
            tagged(log, session.id).warning("repaired (%s): %d record(s) kept, %d intact record(s) and "
                                            "%d damaged byte(s) dropped", how.value, result.kept_records,
                                            result.dropped_records, result.dropped_bytes)
            self._events.set_state(session, Trigger.REPAIR, reason=f"repaired ({how.value})")
            subscribers = set(session.subscribers or ())
            self._intake.forget(session)
            try:
                self._intake.restore(store, loaded)
            except BaseException:
                store.close()
                self._intake.add_damaged(session.id, "cannot be restored after repair", loaded.meta)
                raise
            restored = self._intake.sessions[session.id]
            self._events.add_subscribers(restored, subscribers)
            return restored, result
