"""`StateStore` in memory: the second implementation of the seam, for the
manager's component tests and for the contract suite.

Each session keeps its log as the same framed bytes the file store writes
(`u32 length | u32 crc32 | msgpack`, scanned by the same pure functions),
plus the offset up to which it is "durable".  `crash()` does what a power
loss may do: every session loses what was not synced, and sessions created
with durable=False and never made durable vanish.  Nothing here touches
the disk; everything is lost with the process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from supervisor.store.journal import write_error
from supervisor.logtag import tagged
from supervisor.errors import Fenced, StoreDamaged, StoreError
from supervisor.store.state_store import (
    LoadedSession,
    Meta,
    Record,
    RepairMode,
    RepairResult,
    Snapshot,
    StepRecord,
    boot_state,
    settled,
    turn_steps,
)
from supervisor.store.files import LogScan, describe_damage, frame_record, scan_log
from supervisor.store.spend import Book, Charge, copy_book, fold

__all__ = ["InMemoryStateStore", "MemoryLog", "MemorySpendBook"]

log = logging.getLogger("sessiond.store")


@dataclass(slots=True)
class _Stored:
    log: bytearray = field(default_factory=bytearray)
    synced: int = 0  # bytes of `log` that survive a crash
    snapshot: Snapshot | None = None
    fence: int = 0
    durable: bool = False  # the session itself survives a crash


class MemoryLog:
    def __init__(self, session_id: str, stored: _Stored, generation: int,
                 sessions: dict[str, _Stored], owner: InMemoryStateStore | None = None) -> None:
        self._owner = owner
        self._sessions = sessions
        self._id = session_id
        self._stored = stored
        self._generation = generation
        self._closed = False

    @property
    def generation(self) -> int:
        return self._generation

    def _check(self) -> None:
        if self._closed:
            raise StoreError(f"session {self._id}: this writer was closed")
        if self._stored.fence != self._generation:
            raise Fenced(self._id, self._generation, self._stored.fence)

    def append(self, record: Record, durable: bool) -> None:
        self._check()
        self._stored.log += frame_record(record)
        if durable:
            self._stored.synced = len(self._stored.log)

    def sync(self) -> None:
        self._check()
        self._stored.synced = len(self._stored.log)

    def sync_soon(self) -> asyncio.Future[None]:
        """Completes on a later turn of the loop, as a group commit does."""
        self._check()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        stored, target = self._stored, len(self._stored.log)

        def done() -> None:
            if fut.done():
                return
            failure = self._owner.flush_error if self._owner is not None else None
            if failure is not None:
                del stored.log[stored.synced :]
                fut.set_exception(write_error(f"session {self._id}", failure))
                return
            stored.synced = max(stored.synced, min(target, len(stored.log)))
            fut.set_result(None)

        loop.call_soon(done)
        return fut

    def make_durable_soon(self) -> asyncio.Future[None]:
        return settled(self.make_durable)

    def make_durable(self) -> None:
        self._check()
        self._stored.synced = len(self._stored.log)
        self._stored.durable = True

    def write_snapshot(self, snap: Snapshot) -> None:
        self._check()
        gen = self._stored.snapshot.gen if self._stored.snapshot is not None else 0
        snap.gen = gen + 1
        self._stored.snapshot = snap
        self._stored.log = bytearray()
        self._stored.synced = 0

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        return settled(lambda: self.write_snapshot(snap))

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        return boot_state(*self.read_history())

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        return settled(self.read_for_boot)

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        scan = _checked(self._id, self._stored)  # as load checks: never read past damage
        return self._stored.snapshot, [rec for _, _, rec in scan.records]

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        return settled(self.read_history)

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        return settled(lambda: turn_steps(self.read_history()[1], turn))

    def at_rest(self, rest: bool) -> None:
        pass  # nothing is held open

    def close(self) -> None:
        self._closed = True

    def remove(self) -> None:
        self.close()
        if self._sessions.get(self._id) is self._stored:
            del self._sessions[self._id]

    def remove_soon(self) -> asyncio.Future[None]:
        return settled(self.remove)


def _checked(session_id: str, stored: _Stored) -> LogScan:
    """The log scanned; StoreDamaged for damage followed by intact records
    (a torn tail is load's to cut)."""
    scan = scan_log(bytes(stored.log))
    if scan.damaged:
        snap = stored.snapshot
        meta = snap.meta if snap is not None else next(
            (r for _, _, r in scan.records if isinstance(r, Meta)), None)
        raise StoreDamaged(session_id, describe_damage("log", scan), meta=meta)
    return scan


class MemorySpendBook:
    """`SpendBook` in memory: a write is durable on the loop's next turn
    (as a group commit), unless the store's `flush_error` is set."""

    def __init__(self, owner: InMemoryStateStore) -> None:
        self._owner = owner
        self.book = Book()

    def read(self) -> Book:
        return copy_book(self.book)

    def write(self, charges: list[Charge]) -> asyncio.Future[Book | None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Book | None] = loop.create_future()

        def done() -> None:
            if self._owner.flush_error is not None:
                fut.set_exception(write_error("the spend ledger", self._owner.flush_error))
                return
            for charge in charges:
                fold(self.book, charge)
            fut.set_result(None)

        loop.call_soon(done)
        return fut

    def close(self) -> None:
        pass


class InMemoryStateStore:
    def __init__(self) -> None:
        self.sessions: dict[str, _Stored] = {}
        # For tests: every group commit (sync_soon) fails with this.
        self.flush_error: OSError | None = None
        self.spend = MemorySpendBook(self)

    def create(self, meta: Meta, durable: bool = True) -> MemoryLog:
        if meta.id in self.sessions:
            raise FileExistsError(meta.id)
        stored = _Stored(fence=1)
        self.sessions[meta.id] = stored
        handle = MemoryLog(meta.id, stored, 1, self.sessions, self)
        handle.append(meta, durable=False)
        if durable:
            handle.make_durable()
        return handle

    def load(self, session_id: str) -> tuple[MemoryLog, LoadedSession]:
        stored = self.sessions[session_id]
        scan = _checked(session_id, stored)
        snap = stored.snapshot
        stored.fence += 1
        torn = scan.torn_at
        if torn is not None:
            tagged(log, session_id).warning("dropping %d bytes of a torn last record at offset %d",
                                            scan.size - torn, torn)
            del stored.log[torn:]
            stored.synced = min(stored.synced, torn)
        loaded = LoadedSession.replay(session_id, snap, (rec for _, _, rec in scan.records))
        return MemoryLog(session_id, stored, stored.fence, self.sessions, self), loaded

    def ids(self) -> list[str]:
        return sorted(self.sessions)

    def remove(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def close(self) -> None:
        pass

    def repair(self, session_id: str, mode: RepairMode) -> RepairResult:
        stored = self.sessions[session_id]
        data = bytes(stored.log)
        scan = scan_log(data)
        if not scan.bad:
            return RepairResult(len(scan.records), 0, 0)
        spans = [(a, b) for a, b, _ in scan.records]
        if mode is RepairMode.TRUNCATE:
            spans = [(a, b) for a, b in spans if a < scan.bad[0][0]]
        stored.log = bytearray(b"".join(data[a:b] for a, b in spans))
        stored.synced = len(stored.log)
        return RepairResult(len(spans), len(scan.records) - len(spans),
                            sum(b - a for a, b in scan.bad))

    # ---------------------------------------------------------------- for tests

    def crash(self) -> None:
        """What survives a power loss: synced bytes of durable sessions."""
        for sid in [s for s, st in self.sessions.items() if not st.durable]:
            del self.sessions[sid]
        for stored in self.sessions.values():
            del stored.log[stored.synced :]
