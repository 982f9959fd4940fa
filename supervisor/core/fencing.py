"""Sessions held by another daemon: let go of them here, and claim them
back when asked.

Runs in the daemon's loop.  In the core, not in supervisor/cluster/: every
daemon needs it, a plain one on a file store too.  Every store fences its writers (see
supervisor.store.state_store): once another daemon loaded a session (a second
daemon on the same PostgreSQL database, a front that was frozen or cut off
while another took its sessions over), this daemon's next commit for it is
refused with `Fenced`.  That is not a crash: restarting the worker would
only boot it from the other daemon's records and be refused again at the
next commit, with a second worker running the same session meanwhile.

So the session is *released* here: its worker and tools are terminated as
by `stop`, nothing more is written for it (its log is swapped for an
`UnheldLog`, which refuses every write), and it becomes `hibernated` with
`error` saying who holds it (`status --json`, `ls`); its clients see those
state events.  The same happens when this daemon hears of the claim before
writing anything (supervisor.cluster.fronts).

Released is not lost: the next input, restart or stop that reaches this
daemon for the session *claims* it back (`claim`: the store's `load`, which
fences the other daemon in turn), refreshes what this daemon knows of it
from the store (turns, sequence numbers, usage, a stop made elsewhere),
and then goes on as with any hibernated session.  That is how any daemon
serves any session; the store refuses a claim only while another live
daemon runs a turn of it (`HeldElsewhere`, a conflict for the client).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from supervisor.errors import Conflict, NotFound, NotHeld
from supervisor.logtag import tagged
from supervisor.core.holding import Holding
from supervisor.core.session import Session
from supervisor.store.state_store import (
    Fenced,
    HeldElsewhere,
    Mark,
    Record,
    Snapshot,
    StateStore,
    StepRecord,
    StoreError,
    settled,
)
from supervisor.core.states import State


__all__ = ["EXPECTED", "Fencing", "NotHeld", "UnheldLog", "claim", "held_elsewhere", "release", "release_soon"]

log = logging.getLogger("sessiond.manager")

# How its worker's exit is recorded (last_exit.detail; reason "stopped").
EXPECTED = "held by another daemon"

# Reads a session's stored history without claiming it (None: cannot).
HistoryReader = Callable[[str], tuple[Snapshot | None, list[Record]]]


class UnheldLog:
    """The log of a session another daemon holds: reads go to the store,
    every write is refused with `NotHeld`, except the sequence marks that
    state events here make (they are this daemon's own numbering: the
    holder keeps its own, and a claim takes the larger)."""

    def __init__(self, store: StateStore, session_id: str, reader: HistoryReader | None) -> None:
        self._store = store
        self._id = session_id
        self._reader = reader

    @property
    def generation(self) -> int:
        return 0

    def append(self, record: Record, durable: bool) -> None:
        if not isinstance(record, Mark):
            raise NotHeld(self._id)

    def sync(self) -> None:
        pass  # nothing of this daemon's is pending

    def sync_soon(self) -> asyncio.Future[None]:
        return settled(lambda: None)

    def make_durable(self) -> None:
        pass

    def make_durable_soon(self) -> asyncio.Future[None]:
        return settled(lambda: None)

    def write_snapshot(self, snap: Snapshot) -> None:
        raise NotHeld(self._id)

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        raise NotHeld(self._id)

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        raise NotHeld(self._id)  # claim first

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        raise NotHeld(self._id)

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        if self._reader is None:
            raise NotHeld(self._id)
        return self._reader(self._id)

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        # Rare (another daemon's session): read as `read_history` does.
        return settled(self.read_history)

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        raise NotHeld(self._id)  # (no turn of it runs here)

    def at_rest(self, rest: bool) -> None:
        pass  # the holder's files are not this daemon's

    def close(self) -> None:
        pass

    def remove(self) -> None:
        self._store.remove(self._id)

    def remove_soon(self) -> asyncio.Future[None]:
        return settled(self.remove)  # (rare: the store's own remove)


def held_elsewhere(exc: Fenced) -> str:
    """What a client is told: the session is another daemon's now."""
    if isinstance(exc, NotHeld):
        return str(exc)
    return (f"held by another daemon: it opened the session since (generation {exc.current}, this "
            f"daemon's {exc.mine}); this daemon stopped its worker here and writes nothing more for it "
            "until it is asked for it again")


class Fencing:
    """The manager's `Holds` (supervisor.core.holding): a `Fenced` refusal
    releases the session instead of restarting it, and a released session is
    claimed back before a worker starts for it.  Built before the manager,
    which hands it the core's `Holding` at each call.  `reader` reads a
    session's history without claiming it (daemons sharing a database;
    None: cannot)."""

    def __init__(self, reader: HistoryReader | None = None) -> None:
        self._reader = reader

    def fenced(self, ops: Holding, session: Session, exc: Fenced) -> None:
        release_soon(ops, session, held_elsewhere(exc), self._reader)

    async def claim(self, ops: Holding, session: Session) -> None:
        await claim(ops, session)


def release_soon(ops: Holding, session: Session, reason: str, reader: HistoryReader | None) -> None:
    # Once per refusal: a second one of the same flow (the turn's commit,
    # then its Abort) finds the session released.
    if session.error != reason:
        ops.note(session, reason)
        tagged(log, session.id).warning("%s", reason)
    ops.spawn_task(release(ops, session, reason, reader))


async def release(ops: Holding, session: Session, reason: str, reader: HistoryReader | None) -> None:
    """Let go of a session another daemon holds now: stop its worker as
    `stop` does, write nothing, leave it hibernated here."""
    async with session.locked():
        if isinstance(session.store, UnheldLog) or session.state in (State.DELETED, State.DAMAGED):
            return
        await ops.release(session, reason, UnheldLog(ops.store, session.id, reader), EXPECTED)


async def claim(ops: Holding, session: Session) -> None:
    """Take a released (or never claimed) session back before it gets a
    worker here; a no-op for one this daemon holds.  Caller holds
    session.locked()."""
    if not isinstance(session.store, UnheldLog):
        return
    try:
        held, loaded = ops.store.load(session.id)
    except HeldElsewhere as exc:
        raise Conflict(str(exc)) from None  # unchained: a database's error may quote its DSN
    except KeyError as exc:
        raise NotFound(f"session {session.id} was removed by another daemon") from exc
    if (bad := ops.stored_problem(loaded.meta)) is not None:
        held.close()  # checked again as on create (supervisor.core.workspaces): not acted on
        raise Conflict(f"session {session.id} cannot be taken over: {bad[0]}")
    await ops.refresh(session, held, loaded)
