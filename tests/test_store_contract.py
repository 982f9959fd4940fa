"""The StateStore contract, run over every implementation.

What `supervisor.store.state_store` promises, checked through the seam only.
Each implementation comes with an adapter that plays the part of the world
around it (a crash, a torn write, a flipped byte); a store for which a
fault cannot happen says so with a skip.  A PostgreSQL store joins by
adding an adapter to ADAPTERS: the tests themselves stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pg_server import PgServer
from supervisor.store.memory import InMemoryStateStore
from supervisor.store.state_store import (
    Commit,
    InputRecord,
    Mark,
    Meta,
    RepairMode,
    SessionLog,
    Snapshot,
    StateStore,
    Step,
    StepStart,
)
from supervisor.errors import Fenced, StoreDamaged, StoreFull
from supervisor.store.files import SessionStore
from supervisor.store.filestore import FileStateStore
from supervisor.store.spend import Charge

pytestmark = pytest.mark.component


class Adapter:
    store: StateStore

    def crash(self) -> None:
        """Lose what a power loss may lose; drop every open handle."""
        raise NotImplementedError

    def tear_tail(self, session_id: str, keep: int) -> None:
        """Leave only `keep` bytes of the last record."""
        raise NotImplementedError

    def corrupt_middle(self, session_id: str) -> None:
        """Flip a byte inside the second-to-last record."""
        raise NotImplementedError

    def fail_flushes(self, errno_: int) -> object:
        """Every flush fails with `errno_` until `heal(token)`."""
        raise NotImplementedError

    def heal(self, token: object) -> None:
        raise NotImplementedError


class FileAdapter(Adapter):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.handles: list[SessionStore] = []
        self._open()

    def _open(self) -> None:
        self.file_store = FileStateStore(self.root)
        self.store = self.file_store
        real_create, real_load = self.file_store.create, self.file_store.load

        def create(meta: Meta, durable: bool = True) -> SessionStore:
            h = real_create(meta, durable)
            self.handles.append(h)
            return h

        def load(session_id: str) -> tuple[SessionStore, object]:
            h, loaded = real_load(session_id)
            self.handles.append(h)
            return h, loaded

        self.file_store.create = create  # type: ignore[method-assign]
        self.file_store.load = load  # type: ignore[method-assign, assignment]

    def crash(self) -> None:
        # The page cache is gone: the journal ends where it was last
        # fdatasync'd, and every log loses all this writer appended to it
        # (only the journal was flushed for those records).  The next
        # store replays the journal into the logs.
        journal = self.file_store._journal
        synced = journal.synced_bytes if journal is not None else 0
        for h in self.handles:
            if h._fd >= 0 or h._released:
                with open(h.path / f"log.{h.gen}", "r+b") as f:
                    f.truncate(h._opened if journal is not None else h._synced)
            h.close()
        self.handles.clear()
        if journal is not None:
            journal.abandon()
            with open(journal.path, "r+b") as f:
                f.truncate(synced)
        if self.file_store._spend is not None:
            self.file_store._spend.close()  # (its writes are durable once their futures completed)
        self._open()

    def fail_flushes(self, errno_: int) -> object:
        real = os.fdatasync

        def failing(fd: int) -> None:
            raise OSError(errno_, os.strerror(errno_))

        os.fdatasync = failing
        return real

    def heal(self, token: object) -> None:
        os.fdatasync = token  # type: ignore[assignment]

    def _last_log(self, session_id: str) -> Path:
        logs = sorted((self.root / session_id).glob("log.*"), key=lambda p: int(p.name[4:]))
        return logs[-1]

    def _offsets(self, data: bytes) -> list[int]:
        out, pos = [], 0
        while pos < len(data):
            out.append(pos)
            pos += 8 + int.from_bytes(data[pos : pos + 4], "big")
        return out

    def tear_tail(self, session_id: str, keep: int) -> None:
        path = self._last_log(session_id)
        data = path.read_bytes()
        path.write_bytes(data[: self._offsets(data)[-1] + keep])

    def corrupt_middle(self, session_id: str) -> None:
        path = self._last_log(session_id)
        data = bytearray(path.read_bytes())
        data[self._offsets(bytes(data))[-2] + 10] ^= 0x40
        path.write_bytes(bytes(data))


class MemoryAdapter(Adapter):
    def __init__(self) -> None:
        self.mem = InMemoryStateStore()
        self.store = self.mem

    def crash(self) -> None:
        self.mem.crash()

    def fail_flushes(self, errno_: int) -> object:
        self.mem.flush_error = OSError(errno_, os.strerror(errno_))
        return None

    def heal(self, token: object) -> None:
        self.mem.flush_error = None

    def _offsets(self, data: bytes) -> list[int]:
        return FileAdapter._offsets(self, data)  # type: ignore[arg-type]

    def tear_tail(self, session_id: str, keep: int) -> None:
        stored = self.mem.sessions[session_id]
        del stored.log[self._offsets(bytes(stored.log))[-1] + keep :]

    def corrupt_middle(self, session_id: str) -> None:
        stored = self.mem.sessions[session_id]
        stored.log[self._offsets(bytes(stored.log))[-2] + 10] ^= 0x40


class PgAdapter(Adapter):
    """A real PostgreSQL server (tests/pg_server.py), a schema per test."""

    def __init__(self, server: PgServer) -> None:
        from supervisor.store.postgres.store import PgStateStore

        self.server = server
        self.dsn = server.fresh_dsn()
        self.pg = PgStateStore(self.dsn, retry_secs=30.0)
        self.store = self.pg
        self.handles: list[SessionLog] = []
        real_create, real_load = self.pg.create, self.pg.load

        def create(meta: Meta, durable: bool = True) -> SessionLog:
            h = real_create(meta, durable)
            self.handles.append(h)
            return h

        def load(session_id: str) -> tuple[SessionLog, object]:
            h, loaded = real_load(session_id)
            self.handles.append(h)
            return h, loaded

        self.pg.create = create  # type: ignore[method-assign, assignment]
        self.pg.load = load  # type: ignore[method-assign, assignment]

    def _sql(self, query: str, *args: object) -> None:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(query.encode(), args)

    def crash(self) -> None:
        # The server dies without a checkpoint and recovers from its WAL;
        # the daemon dies too, with whatever it had not sent.
        for h in self.handles:
            h.close()
        self.handles.clear()
        self.server.crash()

    def fail_flushes(self, errno_: int) -> object:
        # The server itself refuses, as a full disk makes it: SQLSTATE 53100.
        assert errno_ == errno.ENOSPC
        self._sql("CREATE FUNCTION sessiond_test_full() RETURNS trigger LANGUAGE plpgsql AS "
                  "$$ BEGIN RAISE EXCEPTION 'no space left' USING ERRCODE = 'disk_full'; END $$")
        self._sql("CREATE TRIGGER sessiond_test_full BEFORE INSERT ON sessiond_records "
                  "FOR EACH STATEMENT EXECUTE FUNCTION sessiond_test_full()")
        return None

    def heal(self, token: object) -> None:
        self._sql("DROP TRIGGER sessiond_test_full ON sessiond_records")
        self._sql("DROP FUNCTION sessiond_test_full()")

    _LAST = "(SELECT pos FROM sessiond_records WHERE session = %s ORDER BY pos DESC LIMIT 1 OFFSET {})"

    def tear_tail(self, session_id: str, keep: int) -> None:
        self._sql("UPDATE sessiond_records SET frame = substring(frame FROM 1 FOR %s) "
                  f"WHERE session = %s AND pos = {self._LAST.format(0)}", keep, session_id, session_id)

    def corrupt_middle(self, session_id: str) -> None:
        self._sql("UPDATE sessiond_records SET frame = set_byte(frame, 10, get_byte(frame, 10) # 64) "
                  f"WHERE session = %s AND pos = {self._LAST.format(1)}", session_id, session_id)


ADAPTERS = ["file", "memory", "postgres"]


@pytest.fixture(params=ADAPTERS)
def ad(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Adapter]:
    adapter: Adapter
    if request.param == "file":
        adapter = FileAdapter(tmp_path)
    elif request.param == "memory":
        adapter = MemoryAdapter()
    else:
        adapter = PgAdapter(request.getfixturevalue("pg_server"))
    yield adapter
    if isinstance(adapter, FileAdapter):
        for h in adapter.handles:
            h.close()
        adapter.file_store.close()
    if isinstance(adapter, PgAdapter):
        adapter.pg.close()


def meta(sid: str = "s1") -> Meta:
    return Meta(id=sid, handler="echo", created_at=1.0)


def commit(turn: int, record: bytes, seq: int) -> Commit:
    return Commit(turn=turn, reply=f"r{turn}", record=record, seq=seq)


def test_round_trip(ad: Adapter) -> None:
    h = ad.store.create(meta())
    h.append(InputRecord(turn=1, text="hi", seq=1), durable=True)
    h.append(commit(1, b"\x01", 2), durable=True)
    h.append(Mark(state="stopped", seq=4096, restarts=2), durable=True)
    h.append(InputRecord(turn=2, text="open", seq=4097), durable=True)
    h.close()
    h2, loaded = ad.store.load("s1")
    assert loaded.meta == meta()
    assert (loaded.turns, loaded.seq, loaded.mark.state, loaded.mark.restarts) == (2, 4097, "stopped", 2)
    assert loaded.open_input is not None and loaded.open_input.text == "open"
    assert h2.read_for_boot() == (b"", [b"\x01"], 1)


@pytest.mark.parametrize("keep", [0, 3, 8, 11])
def test_torn_tail_is_dropped_and_appends_line_up(ad: Adapter, keep: int) -> None:
    h = ad.store.create(meta())
    h.append(commit(1, b"\x01", 1), durable=True)
    h.append(commit(2, b"\x02", 2), durable=True)
    h.close()
    ad.tear_tail("s1", keep)
    h2, loaded = ad.store.load("s1")
    assert loaded.seq == 1 and h2.read_for_boot()[1] == [b"\x01"]
    h2.append(commit(2, b"\x03", 3), durable=True)
    h2.close()
    assert ad.store.load("s1")[0].read_for_boot()[1] == [b"\x01", b"\x03"]


def test_crash_between_append_and_sync(ad: Adapter) -> None:
    h = ad.store.create(meta())
    h.append(commit(1, b"\x01", 1), durable=True)
    h.append(commit(2, b"\x02", 2), durable=False)
    h.sync()  # synced: kept
    h.append(commit(3, b"\x03", 3), durable=False)  # never synced: may be lost, never half-kept
    ad.crash()
    h2, loaded = ad.store.load("s1")
    assert h2.read_for_boot()[1] in ([b"\x01", b"\x02"], [b"\x01", b"\x02", b"\x03"])
    assert loaded.seq in (2, 3)


def test_create_not_made_durable_may_vanish_but_never_half_exists(ad: Adapter) -> None:
    ad.store.create(meta("a"), durable=False)
    ad.store.create(meta("b"), durable=True)
    ad.crash()
    assert "b" in ad.store.ids()
    for sid in ad.store.ids():
        assert ad.store.load(sid)[1].meta.id == sid


def test_snapshot_rotation(ad: Adapter) -> None:
    h = ad.store.create(meta())
    for t in range(1, 4):
        h.append(commit(t, b"\x01", t), durable=True)
    h.write_snapshot(Snapshot(gen=0, meta=meta(), turns=3, seq=3, handler_state=b"S1"))
    h.append(commit(4, b"\x04", 4), durable=True)
    h.write_snapshot(Snapshot(gen=0, meta=meta(), turns=4, seq=4, handler_state=b"S2"))
    h.append(commit(5, b"\x05", 5), durable=True)
    h.close()
    h2, loaded = ad.store.load("s1")
    assert (loaded.turns, loaded.seq) == (4, 5) and loaded.meta.id == "s1"
    assert h2.read_for_boot() == (b"S2", [b"\x05"], 5)


def test_corruption_in_the_middle_is_kept_until_repaired(ad: Adapter) -> None:
    h = ad.store.create(meta())
    for t in range(1, 4):
        h.append(commit(t, bytes([t]), t), durable=True)
    h.close()
    ad.corrupt_middle("s1")  # turn 2's record
    with pytest.raises(StoreDamaged) as exc:
        ad.store.load("s1")
    assert exc.value.meta is not None and exc.value.meta.id == "s1"
    with pytest.raises(StoreDamaged):  # nothing was cut: still damaged
        ad.store.load("s1")
    result = ad.store.repair("s1", RepairMode.SKIP_BAD)
    assert result.kept_records == 3 and result.dropped_bytes > 0  # meta, turns 1 and 3
    h2, loaded = ad.store.load("s1")
    assert h2.read_for_boot()[1] == [b"\x01", b"\x03"] and loaded.seq == 3


def test_damage_found_while_a_writer_holds_the_log_is_never_read_past(ad: Adapter) -> None:
    """The finding: a byte flipped in the middle of a log the daemon holds
    open was read past by a worker's boot (its turn count one short, the
    next turn written after the hole); history and export too.  Every read
    now checks as load does, and the _soon forms alike."""
    h = ad.store.create(meta())
    for t in range(1, 4):
        h.append(commit(t, bytes([t]), t), durable=True)
    assert h.read_for_boot()[1] == [b"\x01", b"\x02", b"\x03"]
    ad.corrupt_middle("s1")  # turn 2's record, under the open writer

    async def soon() -> None:
        with pytest.raises(StoreDamaged):
            await h.read_for_boot_soon()
        with pytest.raises(StoreDamaged):
            await h.read_history_soon()

    for read in (h.read_for_boot, h.read_history):
        with pytest.raises(StoreDamaged) as exc:
            read()
        assert exc.value.meta is not None and exc.value.meta.id == "s1" and exc.value.repairable
    asyncio.run(soon())
    h.close()
    with pytest.raises(StoreDamaged):  # and the next load says the same
        ad.store.load("s1")


def test_an_older_writer_is_fenced_off(ad: Adapter) -> None:
    h1 = ad.store.create(meta())
    h1.append(commit(1, b"\x01", 1), durable=True)
    h2, _ = ad.store.load("s1")
    assert h2.generation > h1.generation
    with pytest.raises(Fenced, match="generation"):
        h1.append(commit(2, b"\xff", 2), durable=True)
    with pytest.raises(Fenced):
        h1.sync()
    with pytest.raises(Fenced):
        h1.write_snapshot(Snapshot(gen=0, meta=meta(), turns=9, seq=9))
    h2.append(commit(2, b"\x02", 3), durable=True)
    h3, loaded = ad.store.load("s1")
    assert h3.read_for_boot()[1] == [b"\x01", b"\x02"] and loaded.seq == 3
    with pytest.raises(Fenced):
        h2.append(commit(3, b"\xff", 4), durable=True)


def test_a_handle_at_rest_writes_and_is_fenced_as_ever(ad: Adapter) -> None:
    h = ad.store.create(meta())
    h.append(commit(1, b"\x01", 1), durable=True)
    h.at_rest(True)
    h.append(commit(2, b"\x02", 2), durable=False)
    h.sync()
    h.at_rest(True)
    h2, loaded = ad.store.load("s1")  # another writer; a loaded handle starts at rest
    assert loaded.seq == 2
    with pytest.raises(Fenced):
        h.append(commit(3, b"\xff", 3), durable=True)
    with pytest.raises(Fenced):
        h.sync()
    h2.append(commit(3, b"\x03", 3), durable=True)
    h2.at_rest(False)
    h2.append(commit(4, b"\x04", 4), durable=True)
    h2.write_snapshot(Snapshot(gen=0, meta=meta(), turns=4, seq=4, handler_state=b"S"))
    h2.at_rest(True)
    h2.append(commit(5, b"\x05", 5), durable=True)
    h2.close()
    h3, loaded = ad.store.load("s1")
    assert loaded.seq == 5 and h3.read_for_boot() == (b"S", [b"\x05"], 5)


def _fds_into(path: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{path}/")
    return n


def test_a_file_session_at_rest_holds_no_fd(tmp_path: Path) -> None:
    store = FileStateStore(tmp_path)
    try:
        h = store.create(meta())
        h.append(commit(1, b"\x01", 1), durable=True)
        assert _fds_into(tmp_path / "s1") == 2  # its fence and its log
        h.at_rest(True)
        assert _fds_into(tmp_path / "s1") == 0
        h.append(commit(2, b"\x02", 2), durable=False)
        assert _fds_into(tmp_path / "s1") == 2  # held while the append waits for its group commit
        asyncio.run(_synced(h))
        assert _fds_into(tmp_path / "s1") == 0
        h.at_rest(False)
        h.append(commit(3, b"\x03", 3), durable=True)
        assert _fds_into(tmp_path / "s1") == 2  # a session with a worker keeps them
        h2, _ = store.load("s1")
        assert _fds_into(tmp_path / "s1") == 2  # h's; the loaded one holds none
        h.close()
        assert _fds_into(tmp_path / "s1") == 0
        h2.append(commit(4, b"\x04", 4), durable=True)
        assert _fds_into(tmp_path / "s1") == 0 and store.load("s1")[1].seq == 4
    finally:
        store.close()


async def _synced(h: SessionLog) -> None:
    await h.sync_soon()


def test_remove_and_list(ad: Adapter) -> None:
    for sid in ("b", "a", "c"):
        ad.store.create(meta(sid)).close()
    assert ad.store.ids() == ["a", "b", "c"]
    with pytest.raises(FileExistsError):
        ad.store.create(meta("a"))
    h, _ = ad.store.load("b")
    h.remove()
    ad.store.remove("c")  # without a handle: what removes a damaged session
    assert ad.store.ids() == ["a"]
    with pytest.raises(KeyError):
        ad.store.load("b")


def test_file_store_fence_check_costs_microseconds(tmp_path: Path) -> None:
    h = SessionStore.create(tmp_path, meta())
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        h._check_fence()
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    h.close()
    print(f"fence check: {per_call_us:.2f} us per append")
    assert per_call_us < 50  # ~1-3 us here; an fsync costs ms


# ---------------------------------------------------------------- group commit (sync_soon)


def test_group_commit_acknowledges_every_session_only_once_durable(ad: Adapter) -> None:
    handles = [ad.store.create(meta(f"g{i}")) for i in range(20)]

    async def main() -> list[bool]:
        futs = []
        for turn in range(1, 4):
            for i, h in enumerate(handles):
                h.append(commit(turn, bytes([i, turn]), turn), durable=False)
                futs.append(h.sync_soon())
        done = await asyncio.gather(*futs)
        return [d is None for d in done]

    assert all(asyncio.run(main()))
    ad.crash()
    for i in range(20):
        h, loaded = ad.store.load(f"g{i}")
        assert h.read_for_boot()[1] == [bytes([i, t]) for t in range(1, 4)] and loaded.seq == 3


def test_a_failed_flush_fails_exactly_the_waiting_appends(ad: Adapter) -> None:
    a, b = ad.store.create(meta("a")), ad.store.create(meta("b"))
    a.append(commit(1, b"\x01", 1), durable=True)

    async def main() -> list[BaseException | None]:
        b.append(commit(1, b"\x02", 1), durable=False)
        a.append(commit(2, b"\x03", 2), durable=False)
        token = ad.fail_flushes(errno.ENOSPC)
        try:
            results = await asyncio.gather(b.sync_soon(), a.sync_soon(), return_exceptions=True)
        finally:
            ad.heal(token)
        # The store works again once the disk does.
        a.append(commit(2, b"\x04", 2), durable=False)
        await a.sync_soon()
        return [r if isinstance(r, BaseException) else None for r in results]

    results = asyncio.run(main())
    assert all(isinstance(r, StoreFull) for r in results), results
    ad.crash()
    assert ad.store.load("a")[0].read_for_boot()[1] == [b"\x01", b"\x04"]
    assert ad.store.load("b")[0].read_for_boot()[1] == []


def test_a_running_turn_s_steps_are_read_back_as_appended_and_after_a_crash(ad: Adapter) -> None:
    """The daemon keeps no step's result: a resumed turn's steps are read
    back from the store (`read_steps_soon`), off the loop, in the order
    they were appended (steps end in any order), a snapshot and the turns
    before notwithstanding; the load counts them without their results."""
    big = bytes(range(256)) * 4096  # 1 MiB
    steps = [StepStart(turn=2, n=0, key="a"), StepStart(turn=2, n=1, key="b"),
             Step(turn=2, n=1, key="b", result=big), Step(turn=2, n=0, key="a", failed=True)]

    async def main() -> tuple[list[object], list[object]]:
        h = ad.store.create(meta(), durable=False)
        await h.make_durable_soon()
        h.append(InputRecord(turn=1, text="one", seq=1), durable=False)
        h.append(Step(turn=1, n=0, key="old", result=b"\x01"), durable=False)
        h.append(commit(1, b"\x01", 2), durable=False)
        await h.sync_soon()
        await h.write_snapshot_soon(Snapshot(gen=0, meta=meta(), turns=1, seq=2, handler_state=b"S"))
        h.append(InputRecord(turn=2, text="two", seq=3), durable=False)
        for rec in steps[:3]:
            h.append(rec, durable=False)
        before_sync = await h.read_steps_soon(2)  # what a worker that died now had sent
        h.append(steps[3], durable=False)
        await h.sync_soon()
        return before_sync, [await h.read_steps_soon(1), await h.read_steps_soon(2)]

    before_sync, (of_one, of_two) = asyncio.run(main())
    assert before_sync == steps[:3] and of_one == [] and of_two == steps
    ad.crash()
    h, loaded = ad.store.load("s1")
    assert loaded.open_input is not None and loaded.open_input.turn == 2
    assert loaded.open_step_records == 4
    assert loaded.open_step_bytes == sum(rec.size for rec in steps) > len(big)

    async def again() -> list[object]:
        return await h.read_steps_soon(2)

    assert asyncio.run(again()) == steps


def test_make_durable_soon_makes_a_create_survive(ad: Adapter) -> None:
    h = ad.store.create(meta("late"), durable=False)
    h.append(commit(1, b"\x01", 1), durable=False)

    async def main() -> None:
        await h.make_durable_soon()
        await h.sync_soon()

    asyncio.run(main())
    ad.crash()
    assert "late" in ad.store.ids()
    h2, loaded = ad.store.load("late")
    assert loaded.meta.id == "late" and h2.read_for_boot()[1] == [b"\x01"]


# ---------------------------------------------------------------- the loop's hot paths (*_soon)


def test_a_snapshot_soon_covers_what_precedes_it_and_nothing_after(ad: Adapter) -> None:
    """Queued behind the session's appends and before the later ones: it
    never overtakes what it covers, nor swallows what follows it."""
    full = (b"", [b"\x01", b"\x02", b"\x03", b"\x04"], 4)  # a store may write it later (file: in a thread)

    async def main() -> tuple[bytes, list[bytes], int]:
        h = ad.store.create(meta(), durable=False)
        await h.make_durable_soon()
        for t in range(1, 4):
            h.append(commit(t, bytes([t]), t), durable=False)
        covered = h.sync_soon()
        snap = h.write_snapshot_soon(Snapshot(gen=0, meta=meta(), turns=3, seq=3, handler_state=b"S"))
        h.append(commit(4, b"\x04", 4), durable=False)
        await asyncio.gather(covered, snap, h.sync_soon())
        return await h.read_for_boot_soon()

    assert asyncio.run(main()) in ((b"S", [b"\x04"], 4), full)
    ad.crash()
    h2, loaded = ad.store.load("s1")
    assert loaded.seq == 4
    assert h2.read_for_boot() in ((b"S", [b"\x04"], 4), full)


def test_a_removal_soon_follows_the_sessions_writes_and_frees_the_id(ad: Adapter) -> None:
    async def main() -> None:
        h = ad.store.create(meta("gone"))
        h.append(commit(1, b"\x01", 1), durable=False)
        landed = h.sync_soon()
        await asyncio.gather(landed, h.remove_soon())
        again = ad.store.create(meta("gone"), durable=False)
        again.append(commit(1, b"\x07", 1), durable=False)
        await again.make_durable_soon()
        await again.sync_soon()

    asyncio.run(main())
    ad.crash()
    assert ad.store.ids() == ["gone"]
    assert ad.store.load("gone")[0].read_for_boot()[1] == [b"\x07"]  # the new one's only


def test_a_create_whose_id_is_taken_writes_nothing(ad: Adapter) -> None:
    """A store may find the id taken only when the create lands (another
    daemon sharing it took the id): then `make_durable_soon` fails with a
    `FileExistsError`, every write of the handle is refused, and its
    removal leaves the other session alone."""
    ad.store.create(meta("a")).close()

    async def main() -> None:
        try:
            h = ad.store.create(Meta(id="a", handler="other", created_at=2.0), durable=False)
        except FileExistsError:
            return  # found at once
        h.append(commit(1, b"\xff", 1), durable=False)
        results = await asyncio.gather(h.make_durable_soon(), h.sync_soon(), return_exceptions=True)
        assert all(isinstance(r, FileExistsError) for r in results), results
        with pytest.raises(FileExistsError):
            h.append(commit(2, b"\xff", 2), durable=True)
        await h.remove_soon()

    asyncio.run(main())
    h, loaded = ad.store.load("a")
    assert loaded.meta.handler == "echo" and h.read_for_boot()[1] == []


# ---------------------------------------------------------------- the spend ledger (StateStore.spend)


def _charge(sid: str, uid: int, calls: int, turn: int = 0, **tokens: int) -> Charge:
    return Charge(session=sid, uid=uid, add={"llm_calls": calls, **tokens}, turn=turn)


def test_spend_charges_are_durable_once_written_and_outlive_the_session(ad: Adapter) -> None:
    h = ad.store.create(meta("s1"))
    h.close()

    async def main() -> None:
        await ad.store.spend.write([_charge("s1", 1000, 1, turn=1), _charge("s1", 1000, 1, turn=1)])
        await ad.store.spend.write([_charge("s1", 1000, 1, turn=2, prompt_tokens=50)])

    asyncio.run(main())
    ad.crash()
    book = ad.store.spend.read()
    assert book.sessions["s1"].spent == {"llm_calls": 3, "prompt_tokens": 50}
    assert (book.sessions["s1"].turn, book.sessions["s1"].turn_spent) == (2, {"llm_calls": 1, "prompt_tokens": 50})
    assert book.uids[1000] == {"llm_calls": 3, "prompt_tokens": 50}
    ad.store.remove("s1")  # the session goes; the ledger is not the session's
    assert ad.store.spend.read().sessions["s1"].spent["llm_calls"] == 3

    async def drop() -> None:
        await ad.store.spend.write([Charge(session="s1", drop=True)])

    asyncio.run(drop())
    ad.crash()
    book = ad.store.spend.read()
    assert "s1" not in book.sessions and book.uids[1000]["llm_calls"] == 3


def test_spend_a_session_opens_once(ad: Adapter) -> None:
    async def main() -> None:
        await ad.store.spend.write([
            Charge(session="imp", uid=7, add={"llm_calls": 9}, opens=True),  # an import: its uid is not charged
            Charge(session="imp", uid=7, add={"llm_calls": 100}, opens=True, uid_too=True),  # too late: no effect
            Charge(session="old", uid=7, add={"llm_calls": 4}, opens=True, uid_too=True),  # from before the ledger
            Charge(session="blind", uid=7, opens=True, unknown=True),
        ])

    asyncio.run(main())
    ad.crash()
    book = ad.store.spend.read()
    assert book.sessions["imp"].spent == {"llm_calls": 9}
    assert book.sessions["old"].spent == {"llm_calls": 4}
    assert book.sessions["blind"].unknown and not book.sessions["imp"].unknown
    assert book.uids[7] == {"llm_calls": 4}
