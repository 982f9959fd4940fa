"""`StateStore` in PostgreSQL: the same records and promises as the file
store, for daemons on several machines sharing one database.

Tables (created and migrated by the store itself, see supervisor.store.postgres.schema):

    sessiond_schema    one row: the schema version this database is at
    sessiond_sessions  one row a session: its fencing generation `gen`, the
                       position of its next record, its snapshot (msgpack)
    sessiond_records   (session, pos, frame): the log after the snapshot,
                       each frame `u32 length | u32 crc32 | msgpack` as in
                       the file store's log
    sessiond_spend     the spend ledger (supervisor.store.postgres.spend)

Commits go through the group commit (supervisor.store.postgres.batch): `sync_soon`
hands the session's appended frames to a writer thread with a connection
of its own, which sends whatever every session has pending as one
statement (one round trip, one transaction, one WAL flush) and completes
each session's future on the loop with its own outcome.  The synchronous
`sync()` (and `append(durable=True)`) goes the same way and waits; so the
records of a session land in the order they were appended.  What keeps each
commit safe:
* the statement is the fencing check, the position claim and the insert
  at once, per session; the server's COMMIT waits for its WAL flush
  (synchronous_commit is forced on), so it is durable when it returns;
* a lost connection is retried with bounded backoff (`retry_secs` in all),
  then reported as `StoreError`; a commit is idempotent because it names
  the position it starts at, so a retry after an unknown outcome cannot
  write a record twice.

`PgStateStore(batch=False)` (SESSIOND_BENCH_PG_BATCH=0 for the daemon, in
benches only) keeps the path before group commit, for comparison: each
commit is its own statement on the loop's connection, and `sync_soon`
returns a settled future.

A session's other writes from the loop go the same way, so that none
waits on the loop and none overtakes another: `create` queues the row and
metadata record first of all (creates of a round share one statement;
`make_durable_soon` completes once it landed), `write_snapshot_soon` and
`remove_soon` queue behind the session's commits.  A revival's read
(`read_for_boot_soon`) waits, on the loop, for the session's requests in
flight, then runs on a reader thread with a connection of its own.  Their
synchronous twins queue the same and wait (tools, tests).  What is left on
the loop's own connection, synchronously: the schema, loads (at start-up,
by a repair, an import), repairs, the list of ids, `read_history`.

Fencing: `load()` bumps `gen` in the transaction that reads the session
back (the row is locked FOR UPDATE first, so no commit can slip between the
read and the claim).  Every write is `UPDATE sessiond_sessions ... WHERE
id = $id AND gen = $mine`: under READ COMMITTED an UPDATE that waited for
a concurrent takeover re-checks its WHERE against the row the takeover
committed, so a stale writer's statement matches no row and writes nothing,
and the store raises `Fenced`, as the file store does.

Damage: PostgreSQL does not tear a row, but a frame can still be damaged
(a restored backup, a hand edit, bit rot without page checksums).  Each
row is checked as the file store checks a record; damaged rows at the end
are dropped on load with a warning (a torn tail), damaged rows followed by
intact ones raise `StoreDamaged` until `repair()`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg

from supervisor.errors import Diverged, Fenced, StoreError, StoreFull
from supervisor.logtag import tagged
from supervisor.store.postgres.batch import (
    CHANNEL,
    CREATE,
    REMOVE,
    SNAPSHOT,
    SNAPSHOT_STATEMENT,
    CommitWriter,
    Request,
)
from supervisor.store.postgres.link import PgLink, PgReader, safe_dsn
from supervisor.store.postgres.rows import Rows, checked, decode_snapshot, replay, snap_encoder
from supervisor.store.postgres.schema import SCHEMA_VERSION, migrate
from supervisor.store.postgres.spend import PgSpendBook
from supervisor.store.postgres.link import store_error as _store_error  # noqa: F401 (tests)
from supervisor.store.state_store import (
    LoadedSession,
    Meta,
    Record,
    RepairMode,
    RepairResult,
    Snapshot,
    StepRecord,
    boot_state,
    logged,
    settled,
    turn_steps,
)
from supervisor.store.files import frame_record

__all__ = ["PgSessionLog", "PgStateStore", "SCHEMA_VERSION", "safe_dsn"]

log = logging.getLogger("sessiond.store")

_T = TypeVar("_T")



# The one statement of a commit: fence check, position claim and insert.
# `next_pos = start` makes a retry of a commit that did land match nothing
# (the caller then finds next_pos = end and knows it landed).
_COMMIT = """
WITH claim AS (
    UPDATE sessiond_sessions SET next_pos = %(end)s
    WHERE id = %(id)s AND gen = %(gen)s AND next_pos = %(start)s
    RETURNING id
)
INSERT INTO sessiond_records (session, pos, frame)
SELECT claim.id, %(start)s + f.ord - 1, f.frame
FROM claim, unnest(%(frames)s::bytea[]) WITH ORDINALITY AS f(frame, ord)
"""

_CREATE = """
WITH s AS (
    INSERT INTO sessiond_sessions (id, gen, next_pos, holder) VALUES (%(id)s, 1, 1, %(holder)s)
    ON CONFLICT (id) DO NOTHING
    RETURNING id
)
INSERT INTO sessiond_records (session, pos, frame) SELECT s.id, 0, %(frame)s FROM s
"""

# For benchmarks only (bench/pg_batch.py): SESSIOND_BENCH_PG_BATCH=0 makes
# the daemon's store commit without group commit, to compare.  Not a setting.
BATCH_BY_DEFAULT = os.environ.get("SESSIOND_BENCH_PG_BATCH", "1") != "0"


class PgSessionLog:
    """One session's rows, held by its one writer.  Runs in the daemon only
    (its loop thread; the writer thread only reads the fields of a
    `Request` and writes `failed_epoch`/`failed_error`/`lost`)."""

    def __init__(self, store: PgStateStore, session_id: str, generation: int, next_pos: int,
                 snap_gen: int, meta_frame: bytes = b"") -> None:
        self._store = store
        self._id = session_id
        self._generation = generation
        self._next_pos = next_pos  # where the next commit starts: after every one sent
        self._snap_gen = snap_gen
        self._pending: list[bytes] = []  # appended, not yet sent
        self._closed = False
        # Group commit (supervisor.store.postgres.batch): requests sent and not yet
        # taken in, oldest first; the epoch starts anew after a failure.
        self._inflight: deque[Request] = deque()  # its create and commits
        self._ops: deque[Request] = deque()  # its snapshots and removal
        self._epoch = 0
        self.failed_epoch = -1
        self.failed_error: StoreError | None = None
        # Its create failed: it writes nothing, ever (see supervisor.store.postgres.batch).
        self.lost: StoreError | None = None
        # Until its create is known to have landed: what a removal checks
        # the row is its own by.
        self._meta_frame = meta_frame

    @property
    def generation(self) -> int:
        return self._generation

    def _check_open(self) -> None:
        if self.lost is not None:
            raise self.lost
        if self._closed:
            raise StoreError(f"session {self._id}: this writer was closed")

    def _fenced_or(self, cur: psycopg.Cursor[Any], landed: Callable[[int], bool]) -> None:
        """After a write matched no row: raise what happened, or return if
        `landed(next_pos)` says an earlier attempt of it did land."""
        cur.execute("SELECT gen, next_pos FROM sessiond_sessions WHERE id = %s", (self._id,))
        row = cur.fetchone()
        if row is None:
            raise StoreError(f"session {self._id}: it was removed; refusing to write")
        gen, next_pos = row
        if gen != self._generation:
            raise Fenced(self._id, self._generation, gen)
        if not landed(next_pos):
            raise StoreError(f"session {self._id}: its log ends at {next_pos}, this writer expected "
                             f"{self._next_pos}; refusing to write")

    def _send(self, frames: list[bytes]) -> None:
        """Without group commit: commit `frames` after everything already
        sent, one statement on the loop's own connection."""
        start, end = self._next_pos, self._next_pos + len(frames)

        def op(cur: psycopg.Cursor[Any]) -> None:
            cur.execute(_COMMIT, {"id": self._id, "gen": self._generation, "start": start,
                                  "end": end, "frames": frames})
            if cur.rowcount != len(frames):
                self._fenced_or(cur, lambda next_pos: next_pos == end)

        self._store.run(op, f"the log of {self._id}")
        self._next_pos = end

    def append(self, record: Record, durable: bool) -> None:
        self._check_open()
        self._pending.append(frame_record(record))
        if durable:
            self.sync()

    def sync(self) -> None:
        """Send what was appended, and wait; on failure it is dropped,
        never kept without anyone being told it was saved."""
        self._check_open()
        writer = self._store.writer
        if writer is not None:
            req = self._submit(writer, _running_loop())
            self._drain()
            if req.error is not None:
                raise req.error
            return
        frames, self._pending = self._pending, []
        if frames:
            self._send(frames)
            return

        def op(cur: psycopg.Cursor[Any]) -> None:  # nothing to send: the fence only
            self._fenced_or(cur, lambda next_pos: next_pos == self._next_pos)

        self._store.run(op, f"the log of {self._id}")

    def make_durable(self) -> None:
        # The create was sent first: the session exists once everything
        # sent so far has landed (or this fails with the create's outcome).
        self.sync()

    def sync_soon(self) -> asyncio.Future[None]:
        """Every append so far, by the group commit: the future completes
        (on this loop) once the writer thread's statement that carried them
        has; it fails with this session's own outcome."""
        writer = self._store.writer
        if writer is None:
            return settled(self.sync)
        self._check_open()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._submit(writer, loop).futures.append(fut)
        return fut

    def make_durable_soon(self) -> asyncio.Future[None]:
        """The create, off the loop: done once its statement (and every
        append since) landed; `IdTaken` if another daemon had the id."""
        return self.sync_soon()

    # ---------------------------------------------------------------- group commit, loop side

    def submit_create(self, writer: CommitWriter) -> None:
        """Queue this new session's row and metadata record (position 0):
        every later write of it follows."""
        req = Request(self, self._id, self._generation, 0, [self._meta_frame], self._epoch,
                      _running_loop(), kind=CREATE, holder=self._store.front)
        writer.submit(req)
        self._next_pos = req.end
        self._inflight.append(req)

    def _submit(self, writer: CommitWriter, loop: asyncio.AbstractEventLoop | None) -> Request:
        """The request that makes every append so far durable: the pending
        frames sent, else the last one in flight, else a fence check."""
        self.settle()
        self._check_open()
        if not self._pending and self._inflight:
            return self._inflight[-1]
        frames, self._pending = self._pending, []
        req = Request(self, self._id, self._generation, self._next_pos, frames, self._epoch, loop)
        writer.submit(req)
        self._next_pos = req.end
        self._inflight.append(req)
        return req

    def _submit_op(self, writer: CommitWriter, loop: asyncio.AbstractEventLoop | None, kind: str,
                   body: bytes = b"", snap_gen: int = 0) -> Request:
        req = Request(self, self._id, self._generation, self._next_pos, [], self._epoch, loop,
                      kind=kind, body=body, snap_gen=snap_gen, holder=self._store.front)
        writer.submit(req)
        self._ops.append(req)
        return req

    def settle(self) -> None:
        """Take in the outcome of every finished request, in order.  After
        a failure, everything sent after it is doomed (the writer fails it
        unsent): the log is back where the failed request began, in a new
        epoch.  After a failed create it is lost (`self.lost`, set by the
        writer thread) and writes nothing more."""
        while self._inflight and self._inflight[0].done.is_set():
            req = self._inflight.popleft()
            if req.settled:
                continue
            req.settled = True
            if req.error is None:
                if req.kind == CREATE:
                    self._meta_frame = b""
                continue
            if req.kind == CREATE and self.lost is None:  # (the writer sets it too; an internal error does not)
                self.lost = req.error
            for doomed in self._inflight:
                doomed.settled = True
            self._inflight.clear()
            self._pending = []
            self._epoch += 1
            self._next_pos = req.error.log_end if isinstance(req.error, Diverged) else req.start
        while self._ops and self._ops[0].done.is_set():
            self._ops.popleft()

    def _drain(self) -> None:
        """Wait (blocking) for every request in flight, and take them in:
        before a synchronous write or read, which must follow them."""
        for req in [*self._inflight, *self._ops]:
            req.done.wait()
        self.settle()

    async def _until_landed(self) -> None:
        """Wait (on the loop) for every request in flight, whatever its outcome."""
        loop = asyncio.get_running_loop()
        waits: list[Awaitable[object]] = []
        for req in [*self._inflight, *self._ops]:
            if req.done.is_set():
                continue
            if req.loop is loop:  # completed by `finish`, on this loop
                fut: asyncio.Future[None] = loop.create_future()
                req.futures.append(fut)
                waits.append(fut)
            else:
                waits.append(asyncio.to_thread(req.done.wait))
        await asyncio.gather(*waits, return_exceptions=True)
        self.settle()

    # ---------------------------------------------------------------- snapshots

    def write_snapshot(self, snap: Snapshot) -> None:
        """The snapshot and the end of every record before it, in one
        statement, and wait.  Records appended and not synced precede it:
        its state covers them, so they go with the rest."""
        self._check_open()
        writer = self._store.writer
        if writer is None:
            self._snapshot_now(snap)
            return
        req = self._snapshot(writer, snap, _running_loop())
        req.done.wait()
        self.settle()
        if req.error is not None:
            raise req.error

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        """The snapshot, queued behind every write of the session so far
        (so it covers exactly them) and before every later one."""
        writer = self._store.writer
        if writer is None:
            return settled(lambda: self.write_snapshot(snap))
        self._check_open()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._snapshot(writer, snap, loop).futures.append(fut)
        return fut

    def _snapshot(self, writer: CommitWriter, snap: Snapshot, loop: asyncio.AbstractEventLoop | None) -> Request:
        if self._pending:
            # Sent first (the snapshot then deletes them): if it fails,
            # they are still there.
            self._submit(writer, loop)
        self._snap_gen += 1
        snap.gen = self._snap_gen
        return self._submit_op(writer, loop, SNAPSHOT, snap_encoder.encode(snap), snap.gen)

    def _snapshot_now(self, snap: Snapshot) -> None:
        """Without group commit: on the loop's own connection."""
        snap.gen = self._snap_gen + 1
        body = snap_encoder.encode(snap)

        def op(cur: psycopg.Cursor[Any]) -> None:
            cur.execute(SNAPSHOT_STATEMENT, {"id": self._id, "gen": self._generation, "snap": body,
                                    "snap_gen": snap.gen})
            if cur.fetchone() is None:
                self._fenced_or(cur, lambda next_pos: False)

        self._store.run(op, f"the snapshot of {self._id}")
        self._pending = []
        self._snap_gen = snap.gen

    # ---------------------------------------------------------------- reading

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        return boot_state(*self.read_history())

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        """A revival's read, on the reader thread's connection, after every
        write of the session in flight has landed."""
        if self._store.reader is None:
            return settled(self.read_for_boot)
        return asyncio.ensure_future(self._boot_state_soon())

    async def _boot_state_soon(self) -> tuple[bytes, list[bytes], int]:
        return boot_state(*await self._history_soon())

    async def _history_soon(self) -> tuple[Snapshot | None, list[Record]]:
        reader = self._store.reader
        assert reader is not None
        await self._until_landed()
        # Appended, not sent: they follow what is stored, unless they are
        # sent and land meanwhile (then they are stored: counted once).
        epoch, base, pending = self._epoch, self._next_pos, list(self._pending)
        body, stored_end, rows = await reader.run(self._read_op, f"session {self._id}")
        if self._epoch == epoch:
            rows += [(base + i, frame) for i, frame in enumerate(pending) if base + i >= stored_end]
        snap = decode_snapshot(self._id, body)
        return snap, checked(self._id, snap, Rows(rows))

    def _read_op(self, cur: psycopg.Cursor[Any]) -> tuple[bytes | None, int, list[tuple[int, bytes]]]:
        """The snapshot, where the log ends, and the records after the
        snapshot with their positions: one statement, so one consistent view."""
        cur.execute(
            "SELECT s.snapshot, s.next_pos, ARRAY(SELECT pos FROM sessiond_records r "
            "WHERE r.session = s.id ORDER BY pos), ARRAY(SELECT frame FROM sessiond_records r "
            "WHERE r.session = s.id ORDER BY pos) FROM sessiond_sessions s WHERE s.id = %s",
            (self._id,))
        row = cur.fetchone()
        if row is None:
            raise StoreError(f"session {self._id}: it was removed")
        return row[0], row[1], [(pos, bytes(frame)) for pos, frame in zip(row[2], row[3], strict=True)]

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        """The snapshot and every record after it (those not yet committed
        by this writer included), as stored; `StoreDamaged` as load has it."""
        self._drain()
        body, stored_end, rows = self._store.run(self._read_op, f"session {self._id}")
        snap = decode_snapshot(self._id, body)
        rows += [(max(stored_end, self._next_pos) + i, frame) for i, frame in enumerate(self._pending)]
        return snap, checked(self._id, snap, Rows(rows))

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        """History and export, on the reader thread's connection, after
        every write of the session in flight has landed: a database that
        does not answer holds up that request, never the loop."""
        if self._store.reader is None:
            return settled(self.read_history)
        return asyncio.ensure_future(self._history_soon())

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        """As history: on the reader thread, after the writes in flight."""
        if self._store.reader is None:
            return settled(lambda: turn_steps(self.read_history()[1], turn))
        return asyncio.ensure_future(self._steps_soon(turn))

    async def _steps_soon(self, turn: int) -> list[StepRecord]:
        return turn_steps((await self._history_soon())[1], turn)

    # ---------------------------------------------------------------- the end

    def at_rest(self, rest: bool) -> None:
        pass  # rows, no files: nothing per session is held open

    def close(self) -> None:
        self._closed = True
        self._pending = []

    def remove(self) -> None:
        """Delete the session, unless a newer writer holds it, and wait."""
        writer = self._store.writer
        if writer is None:
            self._remove_now()
            return
        req = self._remove(writer, _running_loop())
        req.done.wait()
        self.settle()
        if req.error is not None:
            raise req.error

    def remove_soon(self) -> asyncio.Future[None]:
        """The removal, queued behind every write of the session so far.
        Its failure is logged here, whether or not anyone awaits it."""
        writer = self._store.writer
        if writer is None:
            return settled(self.remove)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._remove(writer, loop).futures.append(fut)
        return logged(fut, self._id, "was not deleted from the database")

    def _remove(self, writer: CommitWriter, loop: asyncio.AbstractEventLoop | None) -> Request:
        self.close()
        self.settle()
        # A create not known to have landed (or that failed): its row is
        # deleted only if it is its own.
        return self._submit_op(writer, loop, REMOVE, self._meta_frame)

    def _remove_now(self) -> None:
        """Without group commit: on the loop's own connection."""
        self.close()

        def op(cur: psycopg.Cursor[Any]) -> None:
            cur.execute("DELETE FROM sessiond_sessions WHERE id = %s AND gen = %s",
                        (self._id, self._generation))
            if cur.rowcount:
                self._store._notify_removed(cur, self._id)
            else:
                cur.execute("SELECT gen FROM sessiond_sessions WHERE id = %s", (self._id,))
                row = cur.fetchone()
                if row is not None:
                    raise Fenced(self._id, self._generation, row[0])

        self._store.run(op, f"session {self._id}")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PgStateStore:
    """`StateStore` over one PostgreSQL database.  Opening it connects,
    creates or migrates the schema, and fails with `StoreError` saying why.
    `batch=False`: no group commit, every commit a round trip of its own on
    the caller's thread (the path before group commit; benches compare)."""

    def __init__(
        self,
        dsn: str,
        retry_secs: float = 5.0,
        batch: bool | None = None,
        *,
        front: str | None = None,
        check_claim: Callable[[psycopg.Cursor[Any], str, LoadedSession], None] | None = None,
    ) -> None:
        self._link = PgLink(dsn, retry_secs)
        if batch is None:
            batch = BATCH_BY_DEFAULT
        self.writer = CommitWriter(dsn, retry_secs) if batch else None
        # This daemon's name in `sessiond_sessions.holder` once it shares
        # the database with others, and what a claim checks first inside its
        # transaction (supervisor.cluster.fronts.claim_check); None: alone.
        self.front = front
        self.check_claim = check_claim
        self.reader = PgReader(dsn, retry_secs) if batch else None
        self.run(self._migrate, "the schema")
        self.spend = PgSpendBook(dsn, retry_secs, self._link)

    @property
    def where(self) -> str:
        """The database, as it may be logged (no password)."""
        return self._link.where

    # ---------------------------------------------------------------- plumbing

    def run(self, op: Callable[[psycopg.Cursor[Any]], _T], what: str) -> _T:
        """`op` on the loop's connection (see supervisor.store.postgres.link.PgLink.run)."""
        return self._link.run(op, what)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        with self._link.conn.transaction():
            yield

    def close(self) -> None:
        """Land the commits in flight, then close both connections."""
        self.spend.close()
        if self.writer is not None:
            self.writer.close()
        if self.reader is not None:
            self.reader.close()
        self._link.close()

    def _migrate(self, cur: psycopg.Cursor[Any]) -> None:
        with self._transaction():
            migrate(cur, self.where)

    # ---------------------------------------------------------------- the seam

    def create(self, meta: Meta, durable: bool = True) -> PgSessionLog:
        """The session row and its metadata record in one durable statement,
        by the writer thread, first of the session's writes (with creates
        of other sessions: one statement for all).  `durable=True` waits
        for it here; `durable=False` returns at once, and the caller learns
        the outcome from `make_durable_soon()` (`IdTaken` if another daemon
        sharing the database had the id)."""
        frame = frame_record(meta)
        if self.writer is not None:
            log = PgSessionLog(self, meta.id, 1, 0, 0, meta_frame=frame)
            log.submit_create(self.writer)
            if durable:
                log.make_durable()
            return log
        attempts = 0

        def op(cur: psycopg.Cursor[Any]) -> bool:
            nonlocal attempts
            attempts += 1
            cur.execute(_CREATE, {"id": meta.id, "frame": frame, "holder": self.front})
            if cur.rowcount == 1:
                if self.front is not None:
                    cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"create {meta.id} {self.front}"))
                return True
            if attempts > 1:
                # An earlier attempt's reply was lost: is the row ours?
                cur.execute("SELECT s.gen, r.frame FROM sessiond_sessions s JOIN sessiond_records r "
                            "ON r.session = s.id AND r.pos = 0 WHERE s.id = %s", (meta.id,))
                row = cur.fetchone()
                return row is not None and row[0] == 1 and bytes(row[1]) == frame
            return False

        if not self.run(op, f"session {meta.id}"):
            raise FileExistsError(meta.id)
        return PgSessionLog(self, meta.id, 1, 1, 0)

    @staticmethod
    def read(cur: psycopg.Cursor[Any], session_id: str,
             lock: bool = True) -> tuple[Snapshot | None, int, str | None, Rows]:
        """The session's snapshot, snapshot generation, holder and records;
        with `lock`, inside a transaction, its row locked for it."""
        cur.execute("SELECT snapshot, snap_gen, holder FROM sessiond_sessions WHERE id = %s"
                    + (" FOR UPDATE" if lock else ""), (session_id,))
        row = cur.fetchone()
        if row is None:
            raise KeyError(session_id)
        cur.execute("SELECT pos, frame FROM sessiond_records WHERE session = %s ORDER BY pos",
                    (session_id,))
        rows = Rows([(pos, bytes(frame)) for pos, frame in cur.fetchall()])
        return decode_snapshot(session_id, row[0]), row[1], row[2], rows

    def load(self, session_id: str) -> tuple[PgSessionLog, LoadedSession]:
        """Claim the session: its generation goes up (fencing every earlier
        writer) and, with daemons sharing the database, this daemon becomes
        its holder, in the transaction that reads it back."""
        def op(cur: psycopg.Cursor[Any]) -> tuple[PgSessionLog, LoadedSession]:
            with self._transaction():
                snap, snap_gen, _, rows = self.read(cur, session_id)
                checked(session_id, snap, rows)
                loaded = replay(session_id, snap, rows)
                if self.check_claim is not None:
                    self.check_claim(cur, session_id, loaded)
                torn = rows.torn_at
                if torn is not None:
                    dropped = sum(n for pos, n in rows.bad if pos >= torn)
                    tagged(log, session_id).warning(
                        "dropping %d bytes of a torn last record at position %d", dropped, torn)
                    cur.execute("DELETE FROM sessiond_records WHERE session = %s AND pos >= %s",
                                (session_id, torn))
                cur.execute("UPDATE sessiond_sessions SET gen = gen + 1, holder = %s WHERE id = %s "
                            "RETURNING gen, next_pos", (self.front, session_id))
                claimed = cur.fetchone()
                assert claimed is not None  # locked above
                if self.front is not None:  # delivered on commit, to every daemon listening
                    cur.execute("SELECT pg_notify(%s, %s)",
                                (CHANNEL, f"claim {session_id} {self.front} {claimed[0]}"))
            return PgSessionLog(self, session_id, claimed[0], claimed[1], snap_gen), loaded

        return self.run(op, f"session {session_id}")

    def ids(self) -> list[str]:
        def op(cur: psycopg.Cursor[Any]) -> list[str]:
            cur.execute("SELECT id FROM sessiond_sessions")
            return sorted(row[0] for row in cur.fetchall())

        return self.run(op, "the session list")

    def remove(self, session_id: str) -> None:
        def op(cur: psycopg.Cursor[Any]) -> None:
            cur.execute("DELETE FROM sessiond_sessions WHERE id = %s", (session_id,))
            self._notify_removed(cur, session_id)

        self.run(op, f"session {session_id}")

    def _notify_removed(self, cur: psycopg.Cursor[Any], session_id: str) -> None:
        if self.front is not None and cur.rowcount:  # (after the DELETE)
            cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"remove {session_id} {self.front}"))

    def repair(self, session_id: str, mode: RepairMode) -> RepairResult:
        """Delete damaged rows (skip_bad), or everything from the first
        damaged row on (truncate), in one transaction."""
        def op(cur: psycopg.Cursor[Any]) -> RepairResult:
            with self._transaction():
                _, _, _, rows = self.read(cur, session_id)
                if not rows.bad:
                    return RepairResult(len(rows.records), 0, 0)
                first_bad = rows.bad[0][0]
                drop = [pos for pos, _ in rows.bad]
                kept = [pos for pos, _ in rows.records]
                if mode is RepairMode.TRUNCATE:
                    drop += [pos for pos in kept if pos > first_bad]
                    kept = [pos for pos in kept if pos < first_bad]
                cur.execute("DELETE FROM sessiond_records WHERE session = %s AND pos = ANY(%s)",
                            (session_id, drop))
                return RepairResult(len(kept), len(rows.records) - len(kept),
                                    sum(n for _, n in rows.bad))

        return self.run(op, f"session {session_id}")
