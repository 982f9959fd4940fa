"""Several daemons ("fronts") on one PostgreSQL database: each session is
run by one of them at a time, and any of them can serve any session.

The session's *holder* is the daemon that claimed it last
(`PgStateStore.load`: its fencing generation goes up, `holder` names the
daemon, in one transaction).  A daemon claims a session when it needs to
act on it: an input, a restart, a stop, a repair (supervisor.core.fencing.claim),
not at start.  At start it reads every session without claiming it, so a
daemon that starts takes nothing from the ones already running; only the
sessions this daemon itself held before it stopped are claimed back at
once (ending a turn it was running when it died, as one daemon alone does).

A claim takes an idle session from anyone.  It is refused (`HeldElsewhere`,
a conflict for the client) while another *live* daemon runs a turn of it;
a daemon is live while its row in `sessiond_fronts` is renewed (every third
of `[cluster] front_lease_secs`, by the database's clock, so the machines'
clocks need not agree).  The turn of a daemon that died is ended by the
claim, as a restart does.

What daemons hear of each other: every claim, create and remove is sent on
one PostgreSQL channel (NOTIFY, delivered when its transaction commits).
The thread that renews this daemon's row also LISTENs, and hands each
message to the loop:
* a claim by another daemon of a session held here, of a newer
  generation than this daemon's (an older one crossed this daemon's own
  claim): release it
  (supervisor.core.fencing.release: its worker stopped, `hibernated` here, its
  clients told by the state events);
* a create elsewhere: the session appears here (read, not claimed);
* a remove elsewhere: it is gone here too.
A message lost with a connection is made up for when the thread connects
again: it asks which of this daemon's sessions are still its own, and
which exist.  And none of this is what keeps the data safe: fencing is.  A
daemon that heard nothing (frozen, cut off) is refused at its next write,
and releases the session then.

Identity: a daemon's name is its host name and a random part, kept in
`state_dir/front-id`, so the same daemon restarted knows its own sessions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg

from supervisor.core import fencing
from supervisor.core.fencing import UnheldLog
from supervisor.logtag import tagged
from supervisor.store.postgres.link import PgLink
from supervisor.store.postgres.batch import CHANNEL
from supervisor.store.postgres.store import PgSessionLog, PgStateStore
from supervisor.core.holding import Holding
from supervisor.core.session import Session
from supervisor.store.sessiondir import fsync_dir
from supervisor.store.postgres.rows import describe, replay
from supervisor.store.state_store import (
    HeldElsewhere,
    LoadedSession,
    Record,
    SessionLog,
    Snapshot,
    StoreDamaged,
    StoreError,
)
from supervisor.core.states import State

if TYPE_CHECKING:
    from supervisor.core.manager import SessionManager

__all__ = ["Fronts", "claim_check", "front_id"]

log = logging.getLogger("sessiond.fronts")

# How often the thread looks up from waiting for messages (its stop flag).
_WAKE_SECS = 0.5
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,100}")
# Rows of daemons gone this long are deleted by the next daemon to start.
_FORGET_DEAD = "1 day"


def front_id(state_dir: Path) -> str:
    """This daemon's name among the daemons sharing the database: made once
    (host name and a random part), then read back at every start.  A name
    is one word (it travels in space-separated messages on the channel)."""
    path = state_dir / "front-id"
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        name = ""
    if name:
        if not _NAME.fullmatch(name):
            raise StoreError(f"{path} holds {name[:80]!r}, not a daemon's name (letters, digits, '.', '_', "
                             "':' and '-', at most 100): delete it and a new name is made")
        return name
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:80] or "host"
    name = f"{host}:{secrets.token_hex(4)}"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(state_dir)  # else a crash could make it a stranger to its own sessions
    return name


class _Lease:
    """This daemon's row in `sessiond_fronts`, renewed from a thread with a
    connection of its own, which also LISTENs on the channel."""

    def __init__(self, dsn: str, retry_secs: float, front: str, lease_secs: float,
                 hear: Callable[[str], None]) -> None:
        self._link = PgLink(dsn, retry_secs, name="sessiond-front")
        self._front = front
        self._lease_secs = lease_secs
        self._hear = hear
        self._stop = threading.Event()
        self._listening: Any = None  # the connection LISTEN was sent on
        self._renew_at = 0.0
        self._thread = threading.Thread(target=self._run, name="sessiond-front", daemon=True)

    def open(self) -> None:
        """Register (fails the start when the database cannot hold it)."""
        def op(cur: psycopg.Cursor[Any]) -> None:
            cur.execute(f"DELETE FROM sessiond_fronts WHERE expires_at < now() - interval '{_FORGET_DEAD}'")
            self._renew(cur)

        self._link.run(op, "this daemon's row in sessiond_fronts")
        self._thread.start()

    def _renew(self, cur: psycopg.Cursor[Any]) -> None:
        cur.execute(
            "INSERT INTO sessiond_fronts (id, host, pid, expires_at) "
            "VALUES (%s, %s, %s, now() + make_interval(secs => %s)) ON CONFLICT (id) DO UPDATE "
            "SET host = excluded.host, pid = excluded.pid, expires_at = excluded.expires_at",
            (self._front, socket.gethostname(), os.getpid(), self._lease_secs))
        self._renew_at = time.monotonic() + self._lease_secs / 3

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._link.run(self._serve, "this daemon's row in sessiond_fronts")
            except StoreError as exc:
                log.warning("cannot renew this daemon's hold on its sessions (%s); retrying. Once it is "
                            "%gs old ([cluster] front_lease_secs), another daemon may end a turn running here",
                            exc, self._lease_secs)
                self._stop.wait(1.0)
            except Exception:  # never let the thread die quietly
                log.exception("the front's lease thread failed; retrying")
                self._stop.wait(1.0)

    def _serve(self, cur: psycopg.Cursor[Any]) -> None:
        conn = self._link.conn
        if self._listening is not conn:
            cur.execute(f"LISTEN {CHANNEL}")
            self._renew(cur)
            if self._listening is not None:
                self._hear("resync")  # messages may have been lost with the old connection
            self._listening = conn
        while not self._stop.is_set():
            for note in conn.notifies(timeout=_WAKE_SECS):
                self._hear(note.payload)
            if time.monotonic() >= self._renew_at:
                self._renew(cur)

    def close(self) -> None:
        """Stop renewing and delete the row: what this daemon held can be
        claimed at once (nothing of it runs once the daemon has shut down)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(_WAKE_SECS * 4 + self._link.retry_secs)
        try:
            self._link.run(lambda cur: cur.execute("DELETE FROM sessiond_fronts WHERE id = %s",
                                                   (self._front,)), "this daemon's row in sessiond_fronts")
        except StoreError as exc:
            log.warning("%s (its hold runs out by itself)", exc)
        self._link.close()


def claim_check(front: str) -> Callable[[psycopg.Cursor[Any], str, LoadedSession], None]:
    """What a claim checks inside its transaction (the row locked), for
    `PgStateStore(check_claim=...)`: refuse to take a turn away from a live
    daemon (one whose row is renewed); a dead one's turn is the claimer's to
    end.  An idle session is taken from anyone: that is what lets any daemon
    serve any session."""

    def check(cur: psycopg.Cursor[Any], session_id: str, loaded: LoadedSession) -> None:
        if loaded.open_input is None:
            return
        cur.execute("SELECT s.holder, f.host, f.pid FROM sessiond_sessions s JOIN sessiond_fronts f "
                    "ON f.id = s.holder WHERE s.id = %s AND f.expires_at > now()", (session_id,))
        row = cur.fetchone()
        if row is not None and row[0] != front:
            raise HeldElsewhere(session_id, f"{row[1]} (pid {row[2]})", loaded.open_input.turn)

    return check


class Fronts:
    """The daemon's side: open sessions at start, act on what is heard."""

    def __init__(self, store: PgStateStore, dsn: str, retry_secs: float, lease_secs: float, front: str) -> None:
        self._store = store
        self.front = front
        self._manager: SessionManager | None = None
        self._ops: Holding | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease = _Lease(dsn, retry_secs, self.front, lease_secs, self._hear_threadsafe)
        # The manager's `Holds`: released sessions are read through this
        # daemon's reader (history without a claim).
        self.holds = fencing.Fencing(self.read_history)

    def start(self, loop: asyncio.AbstractEventLoop, manager: SessionManager, ops: Holding) -> None:
        """Listen, on behalf of `manager` (built after this: it opens its
        sessions through `open_stored`); `ops` lets go of sessions."""
        self._loop = loop
        self._manager = manager
        self._ops = ops
        self._lease.open()
        log.info("sharing the database as %s: sessions are claimed when used", self.front)

    @property
    def _holding(self) -> Holding:
        assert self._ops is not None, "heard before start"
        return self._ops

    @property
    def _core(self) -> SessionManager:
        assert self._manager is not None, "heard before start"
        return self._manager

    def close(self) -> None:
        self._lease.close()

    # ---------------------------------------------------------------- at start

    def open_stored(self, session_id: str) -> tuple[SessionLog, LoadedSession]:
        """The session as stored; claimed only if this daemon held it."""
        loaded, holder = self.peek(session_id)
        if holder == self.front:
            return self._store.load(session_id)
        loaded.open_input = None  # its turn is its holder's, or its claimer's to end
        return UnheldLog(self._store, session_id, self.read_history), loaded

    def peek(self, session_id: str) -> tuple[LoadedSession, str | None]:
        """The session as stored, and the daemon holding it, without
        claiming it (nothing is written)."""
        def op(cur: psycopg.Cursor[Any]) -> tuple[LoadedSession, str | None]:
            snap, _, holder, rows = self._store.read(cur, session_id, lock=False)
            if rows.damaged:
                raise StoreDamaged(session_id, describe(rows), meta=snap.meta if snap is not None else rows.meta())
            return replay(session_id, snap, rows), holder

        return self._store.run(op, f"session {session_id}")

    def read_history(self, session_id: str) -> tuple[Snapshot | None, list[Record]]:
        """Read, never written: a log of generation 0 writes nothing."""
        return PgSessionLog(self._store, session_id, 0, 0, 0).read_history()

    # ---------------------------------------------------------------- heard

    def _hear_threadsafe(self, payload: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.hear, payload)
            except RuntimeError:  # closed meanwhile: the daemon is gone
                pass

    def hear(self, payload: str) -> None:
        """One message from the channel (or "resync"), on the loop."""
        if self._manager is None or self._manager.closing:
            return
        try:
            if payload == "resync":
                self._resync()
                return
            kind, session_id, front, *rest = payload.split(" ")
            # A claim says the generation it took: an older one than this
            # daemon's own (a message that crossed this daemon's claim of
            # the session) is not a reason to let go.
            gen = int(rest[0]) if kind == "claim" and len(rest) == 1 else None
            if (kind == "claim") != (gen is not None) or (kind != "claim" and rest):
                raise ValueError(payload)
        except ValueError:
            log.warning("ignoring a malformed message on %s: %r", CHANNEL, payload[:200])
            return
        except StoreError as exc:
            log.warning("cannot compare this daemon's sessions with the database: %s", exc)
            return
        if front == self.front:
            return
        session = self._core.sessions.get(session_id)
        if kind == "claim" and session is not None and gen is not None and gen > session.store.generation:
            self._let_go(session, front)
        elif kind == "create" and session is None:
            self._adopt(session_id)
        elif kind == "remove" and session is not None:
            self._forget(session, front)

    def _let_go(self, session: Session, holder: str) -> None:
        if not isinstance(session.store, UnheldLog):
            fencing.release_soon(self._holding, session, f"taken over by another daemon ({holder})", self.read_history)

    def _adopt(self, session_id: str) -> None:
        try:
            loaded, _ = self.peek(session_id)
        except (KeyError, StoreDamaged):
            return  # gone again, or for its holder to report
        except StoreError as exc:
            tagged(log, session_id).warning("created elsewhere, not readable here yet: %s", exc)
            return
        if session_id not in self._core.sessions:
            loaded.open_input = None
            self._core.restore(UnheldLog(self._store, session_id, self.read_history), loaded)

    def _forget(self, session: Session, by: str) -> None:
        """Removed by another daemon, which claimed it first: let go of it
        (if that message is still on its way), then forget it."""
        self._core.spawn_task(self._forget_released(session, by))

    async def _forget_released(self, session: Session, by: str) -> None:
        await fencing.release(self._holding, session, f"removed by another daemon ({by})", self.read_history)
        self._holding.removed(session, f"removed by another daemon ({by})")

    def _resync(self) -> None:
        """After a lost connection: what was missed, from the table."""
        def op(cur: psycopg.Cursor[Any]) -> dict[str, str | None]:
            cur.execute("SELECT id, holder FROM sessiond_sessions")
            return {row[0]: row[1] for row in cur.fetchall()}

        holders = self._store.run(op, "the session list")
        for session_id, session in list(self._core.sessions.items()):
            if session_id not in holders:
                if session.state is not State.DAMAGED:
                    self._forget(session, "unknown")
            elif holders[session_id] != self.front:
                self._let_go(session, holders[session_id] or "none")
        for session_id in holders.keys() - self._core.sessions.keys():
            self._adopt(session_id)
