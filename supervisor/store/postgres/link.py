"""One connection to the PostgreSQL store's database, re-made when lost.

The store has three (supervisor.store.postgres.store), each used by one thread only (a
psycopg connection is not for concurrent use):
* the daemon loop's, for what the loop does synchronously: the schema,
  loads at start-up, repairs, listing, and the blocking twins of the
  `*_soon` operations when a caller wants to wait (tools, tests);
* the group-commit writer thread's (supervisor.store.postgres.batch), for every write
  of a session made from the loop: creates, commits, snapshots, removals;
* the reader thread's (`PgReader`), for a revival's read of a session,
  so that the loop does not wait for it.

Every database error leaves `run` as ours (`raise Ours(...) from exc`, at
this one boundary): `StoreFull` when the server is out of space,
`Unreachable` once a lost connection could not be re-made within
`retry_secs`, `StoreError` for anything else the server refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
from psycopg import errors as pgerr
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from supervisor.errors import StoreError, StoreFull, Unreachable

__all__ = ["PgLink", "PgReader", "first_line", "safe_dsn", "store_error"]

log = logging.getLogger("sessiond.store")

_T = TypeVar("_T")

# Connection defaults a DSN may override: fail fast instead of hanging the
# loop on a dead peer (tcp_user_timeout: unacknowledged data, in ms).
_DSN_DEFAULTS = {"connect_timeout": "5", "tcp_user_timeout": "5000", "keepalives_idle": "10",
                 "application_name": "sessiond"}


def safe_dsn(dsn: str) -> str:
    """The DSN as it may be logged: without its password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(an unparsable dsn)"
    params.pop("password", None)
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def store_error(what: str, exc: psycopg.Error) -> StoreError:
    """A database error as ours: `StoreFull` when the server is out of space."""
    if isinstance(exc, (pgerr.DiskFull, pgerr.OutOfMemory, pgerr.ProgramLimitExceeded)):
        return StoreFull(f"cannot write {what}: the PostgreSQL server is out of space ({first_line(exc)})")
    return StoreError(f"cannot write {what}: PostgreSQL said: {first_line(exc)}")


class PgLink:
    """A connection used by one thread; `run` re-makes it when lost."""

    def __init__(self, dsn: str, retry_secs: float, name: str = "sessiond") -> None:
        self._dsn = dsn
        self.where = safe_dsn(dsn)
        self.retry_secs = retry_secs
        self._name = name
        self._conn: psycopg.Connection[Any] | None = None

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The live connection (inside `run` only)."""
        assert self._conn is not None
        return self._conn

    def _connect(self) -> psycopg.Connection[Any]:
        params = {**_DSN_DEFAULTS, "application_name": self._name, **conninfo_to_dict(self._dsn)}
        host = str(params.get("host") or "")
        if not host or host.startswith("/"):
            params.pop("tcp_user_timeout")  # a Unix socket: no TCP
        conn = psycopg.connect(make_conninfo(**{k: str(v) for k, v in params.items()}),
                               autocommit=True)
        try:
            self._prepare(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        with conn.cursor() as cur:
            cur.execute("SHOW synchronous_commit")
            row = cur.fetchone()
            if row is not None and row[0] == "off":
                # A commit must be on disk when it returns: that is the promise.
                cur.execute("SET synchronous_commit = on")
            # A takeover holds a session's row for a moment; anything longer
            # is a stuck peer, and the loop must not wait on it.
            cur.execute("SET lock_timeout = '5s'")
            cur.execute("SHOW fsync")
            row = cur.fetchone()
            if row is not None and row[0] == "off":
                log.warning("the PostgreSQL server at %s runs with fsync = off: a crash of its "
                            "machine can lose acknowledged turns", self.where)

    def run(self, op: Callable[[psycopg.Cursor[Any]], _T], what: str) -> _T:
        """Run `op` with a cursor; a lost connection is re-made and `op`
        run again (each op is safe to repeat) until `retry_secs` have gone
        by.  Every database error leaves here as a `StoreError`."""
        deadline = time.monotonic() + self.retry_secs
        delay = 0.05
        while True:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                with self._conn.cursor() as cur:
                    return op(cur)
            except psycopg.OperationalError as exc:
                if self._conn is not None and not (self._conn.closed or self._conn.broken):
                    raise store_error(what, exc) from exc  # the server refused, the link is fine
                self.close()
                if time.monotonic() + delay > deadline:
                    raise Unreachable(f"cannot write {what}: the PostgreSQL server at {self.where} "
                                      f"cannot be reached ({first_line(exc)}); gave up after "
                                      f"{self.retry_secs:g}s") from exc
                log.warning("PostgreSQL connection lost (%s); retrying in %.2fs", first_line(exc), delay)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except psycopg.Error as exc:
                raise store_error(what, exc) from exc

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
            self._conn = None


class PgReader:
    """Reads off the daemon's loop: one thread, started at first use, with
    a connection of its own (`PgLink`, made and used in that thread only).
    One thread: reads queue behind each other, not behind the commits."""

    def __init__(self, dsn: str, retry_secs: float) -> None:
        self._link = PgLink(dsn, retry_secs, name="sessiond-reads")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sessiond-pg-reads")

    def run(self, op: Callable[[psycopg.Cursor[Any]], _T], what: str) -> asyncio.Future[_T]:
        """`op` on the reader's connection (see `PgLink.run`), as a future
        of the calling loop."""
        return asyncio.wrap_future(self._pool.submit(self._link.run, op, what))

    def close(self) -> None:
        """Let the reads in progress end, then close the connection."""
        self._pool.shutdown(wait=True)
        self._link.close()
