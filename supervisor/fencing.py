"""A session that another daemon took over: stop its worker here and write
nothing more for it.

Runs in the daemon's loop.  Every store fences its writers (see
supervisor.state_store): once another daemon loaded a session (a second
daemon on the same PostgreSQL database, a front that was frozen or cut off
while another took its sessions over), this daemon's next commit for it is
refused with `Fenced`.  That is not a crash: restarting the worker would
only boot it from the other daemon's records and be refused again at the
next commit, with a second worker running the same session meanwhile.  So
the session is stopped here (its worker and tools terminated as by `stop`,
then `stopped`, no restart) and says why in `error`, which `status --json`
and `ls` show: it is held by another daemon.  Nothing is written for it:
the stored state is the other daemon's now.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from supervisor.logtag import tagged
from supervisor.session import Session
from supervisor.state_store import Fenced
from supervisor.states import State, Trigger

if TYPE_CHECKING:
    from supervisor.manager import SessionManager

__all__ = ["EXPECTED", "held_elsewhere", "wire"]

log = logging.getLogger("sessiond.manager")

# How its worker's exit is recorded (last_exit.detail; reason "stopped").
EXPECTED = "held by another daemon"


def held_elsewhere(exc: Fenced) -> str:
    """What a client is told: the session is another daemon's now."""
    return (f"held by another daemon: it opened the session since (generation {exc.current}, this "
            f"daemon's {exc.mine}); this daemon stopped its worker and writes nothing more for it")


def wire(manager: SessionManager) -> None:
    """Route the ledger's `Fenced` to `_release` instead of a restart."""
    manager.ledger.on_fenced = lambda session, exc: _release_soon(manager, session, exc)


def _release_soon(manager: SessionManager, session: Session, exc: Fenced) -> None:
    # Once per refusal: a second one of the same flow (the turn's commit,
    # then its Abort) finds the session stopped.  An operator's `restart`
    # of it runs a worker again, whose next write is refused again.
    reason = held_elsewhere(exc)
    if session.error != reason:
        session.error = reason
        tagged(log, session.id).warning("%s", reason)
    manager._spawn_task(_release(manager, session))


async def _release(manager: SessionManager, session: Session) -> None:
    """Stop the worker, as `stop` does, but write no mark: the store is
    the other daemon's."""
    async with session.lock:
        if session.state in (State.STOPPING, State.STOPPED, State.DELETED, State.DAMAGED):
            return
        manager.workers.cancel_restart(session)
        reason = session.error or EXPECTED
        manager.events.set_state(session, Trigger.STOP, reason=reason)
        await manager.workers.terminate(session, EXPECTED, manager.config.daemon.stop_grace_secs)
        manager.events.set_state(session, Trigger.STOPPED, reason=reason)
