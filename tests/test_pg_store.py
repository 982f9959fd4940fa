"""The PostgreSQL store beyond the shared contract: fencing between two
writers (each with its own connection, as two daemons would have), a
takeover racing a commit, lost connections, the schema, and a real daemon
running on it.  Every test uses the real server of tests/pg_server.py."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import msgspec
import psutil
import psycopg
import pytest
import tomli_w

from conftest import FAST_CONFIG
from harness import wait_for
from pg_server import PgServer
from supervisor.ctl.client import Client, RequestError, TurnFailedError
from supervisor.config import parse_config
from supervisor.errors import ConfigError
from supervisor.store.postgres import batch as pg_batch
from supervisor.store.postgres.store import SCHEMA_VERSION, PgSessionLog, PgStateStore, safe_dsn
from supervisor.store.state_store import Commit, InputRecord, Meta, Snapshot
from supervisor.errors import Fenced, IdTaken, StoreError, StoreFull
from supervisor.store.files import frame_record


def meta(sid: str = "s1") -> Meta:
    return Meta(id=sid, handler="echo", created_at=1.0)


def commit(turn: int, seq: int) -> Commit:
    return Commit(turn=turn, reply=f"r{turn}", record=bytes([turn]), seq=seq)


@pytest.fixture
def dsn(pg_server: PgServer) -> str:
    return pg_server.fresh_dsn()


@pytest.fixture
def stores(dsn: str) -> Iterator[list[PgStateStore]]:
    made: list[PgStateStore] = []
    yield made
    for store in made:
        store.close()


def sql(dsn: str, query: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query.encode(), args)
        return cur.fetchall() if cur.description else []


def log_rows(dsn: str, sid: str = "s1") -> list[bytes]:
    return [bytes(r[0]) for r in sql(dsn, "SELECT frame FROM sessiond_records WHERE session = %s "
                                          "ORDER BY pos", sid)]


# ---------------------------------------------------------------- fencing


@pytest.mark.component
def test_a_takeover_by_another_daemon_fences_the_old_writer(dsn: str, stores: list[PgStateStore]) -> None:
    first, second = PgStateStore(dsn), PgStateStore(dsn)
    stores += [first, second]
    old = first.create(meta())
    old.append(InputRecord(turn=1, text="a", seq=1), durable=False)
    old.append(commit(1, 2), durable=True)
    old.append(InputRecord(turn=2, text="unsent", seq=3), durable=False)
    new, loaded = second.load("s1")  # the other node takes the session over
    assert new.generation == old.generation + 1 and loaded.turns == 1
    with pytest.raises(Fenced, match=f"holds generation {old.generation} but generation {new.generation}"):
        old.sync()  # the stale writer's buffered input: refused, not written
    with pytest.raises(Fenced):
        old.append(commit(2, 4), durable=True)
    new.append(InputRecord(turn=2, text="b", seq=3), durable=True)
    assert [f for f in log_rows(dsn)][1:] == [
        frame_record(InputRecord(turn=1, text="a", seq=1)), frame_record(commit(1, 2)),
        frame_record(InputRecord(turn=2, text="b", seq=3))]  # no interleaving
    with pytest.raises(Fenced):
        old.remove()  # nor may it delete the session under the new writer
    assert second.ids() == ["s1"]


@pytest.mark.component
def test_a_commit_that_waited_for_a_takeover_is_refused(dsn: str, stores: list[PgStateStore]) -> None:
    """The race the row lock decides: a commit blocked behind a takeover's
    uncommitted claim re-checks the generation once the claim commits."""
    store = PgStateStore(dsn)
    stores.append(store)
    writer = store.create(meta())
    writer.append(commit(1, 1), durable=True)
    outcome: list[BaseException | None] = []
    with psycopg.connect(dsn) as takeover:  # not autocommit: a transaction held open
        takeover.execute(b"UPDATE sessiond_sessions SET gen = gen + 1 WHERE id = 's1'")

        def write() -> None:
            try:
                writer.append(commit(2, 2), durable=True)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
                outcome.append(exc)

        thread = threading.Thread(target=write)
        thread.start()
        wait_for(lambda: sql(dsn, "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE 'sessiond%%' "
                                  "AND wait_event_type = 'Lock'"), 10, "the commit to wait for the row lock")
        takeover.commit()
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Fenced), outcome
    assert log_rows(dsn)[1:] == [frame_record(commit(1, 1))]


# ---------------------------------------------------------------- connections


@pytest.mark.component
def test_a_lost_connection_is_remade_and_the_commit_lands_once(
    dsn: str, stores: list[PgStateStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = PgStateStore(dsn)
    stores.append(store)
    writer = store.create(meta())
    writer.append(commit(1, 1), durable=True)  # both connections made
    sql(dsn, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'sessiond%%'")
    writer.append(commit(2, 2), durable=True)
    assert log_rows(dsn)[1:] == [frame_record(commit(1, 1)), frame_record(commit(2, 2))]
    assert "PostgreSQL connection lost" in caplog.text


@pytest.mark.component
def test_a_retry_of_a_commit_that_landed_writes_nothing_twice(dsn: str, stores: list[PgStateStore]) -> None:
    # What a retry after a lost reply sees: its rows are there already.
    store = PgStateStore(dsn)
    stores.append(store)
    writer = store.create(meta())
    start = writer._next_pos
    writer.append(commit(1, 1), durable=True)
    writer._next_pos = start  # as if the reply had been lost
    writer.append(commit(1, 1), durable=True)
    assert log_rows(dsn)[1:] == [frame_record(commit(1, 1))]
    writer.append(commit(2, 2), durable=True)
    assert len(log_rows(dsn)) == 3


@pytest.mark.component
def test_a_server_that_stays_away_is_a_store_error_and_then_comes_back(
    pg_server: PgServer, dsn: str, stores: list[PgStateStore]
) -> None:
    store = PgStateStore(dsn, retry_secs=0.3)
    stores.append(store)
    writer = store.create(meta())
    pg_server.stop()
    try:
        with pytest.raises(StoreError, match="cannot be reached.*gave up after 0.3s") as exc:
            writer.append(commit(1, 1), durable=True)
        assert not isinstance(exc.value, Fenced)
        assert "password" not in str(exc.value)
    finally:
        pg_server.start()
    writer.append(commit(2, 2), durable=True)  # the failed record was dropped, not kept
    assert log_rows(dsn)[1:] == [frame_record(commit(2, 2))]


# ---------------------------------------------------------------- group commit


def writer_waits_for_a_lock(dsn: str) -> None:
    wait_for(lambda: sql(dsn, "SELECT 1 FROM pg_stat_activity WHERE application_name = 'sessiond-commits' "
                              "AND wait_event_type = 'Lock'"), 10, "the commit writer to wait for a row lock")


def hold_row(conn: psycopg.Connection[object], sid: str) -> None:
    """Lock a session's row in `conn`'s open transaction: the writer's
    statement that touches it waits, and what is submitted meanwhile queues."""
    conn.execute(b"SELECT 1 FROM sessiond_sessions WHERE id = %s FOR UPDATE", (sid,))


class _Log:
    def __init__(self) -> None:
        self.failed_epoch, self.failed_error, self.lost = -1, None, None

    def settle(self) -> None:
        pass


@pytest.mark.pure
def test_a_round_keeps_each_sessions_order_and_holds_back_what_cannot_go() -> None:
    a, b, c, gone = _Log(), _Log(), _Log(), _Log()
    b.failed_epoch, b.failed_error = 0, StoreError("b's disk")
    gone.lost = IdTaken("l: taken")  # type: ignore[assignment]

    def req(log: _Log, sid: str, start: int, n: int, epoch: int = 0, kind: str = pg_batch.COMMIT,
            body: bytes = b"") -> pg_batch.Request:
        return pg_batch.Request(log, sid, 1, start, [b"f"] * n, epoch, None,  # type: ignore[arg-type]
                                kind=kind, body=body)

    a1, a2, b1, b2, a_gap = req(a, "a", 1, 2), req(a, "a", 3, 1), req(b, "b", 5, 1), req(b, "b", 5, 1, epoch=1), \
        req(a, "a", 9, 1)
    c0, c1, c_snap, c2 = (req(c, "c", 0, 1, kind=pg_batch.CREATE), req(c, "c", 1, 1),
                          req(c, "c", 2, 0, kind=pg_batch.SNAPSHOT), req(c, "c", 2, 1))
    b_snap = req(b, "b", 5, 0, kind=pg_batch.SNAPSHOT)  # of the failed epoch: still goes
    g1, g_rm = req(gone, "g", 1, 1), req(gone, "g", 1, 0, kind=pg_batch.REMOVE, body=b"its meta")
    plan = pg_batch._plan([a1, c0, b1, c1, a2, c_snap, b2, c2, a_gap, b_snap, g1, g_rm])
    assert plan.creates == [c0]
    assert [(e.sid, e.start, e.end, e.reqs) for e in plan.entries] == [
        ("a", 1, 4, [a1, a2]), ("c", 1, 2, [c1]), ("b", 5, 6, [b2])]
    assert plan.ops == [c_snap, b_snap, g_rm]  # a lost log's removal of its own row goes
    assert plan.doomed == [(b1, b.failed_error), (g1, gone.lost)]  # unsent
    # c2 would overtake c's snapshot; a_gap does not follow a2: the next round.
    assert plan.later == [c2, a_gap]


@pytest.mark.component
def test_one_statement_lands_every_session_but_the_fenced_one(dsn: str, stores: list[PgStateStore]) -> None:
    store, other = PgStateStore(dsn), PgStateStore(dsn, batch=False)
    stores += [store, other]
    logs = [store.create(meta(f"s{i}")) for i in range(6)]
    assert store.writer is not None
    other.load("s3")  # another daemon took s3 over

    async def main() -> list[BaseException | None]:
        with psycopg.connect(dsn) as blocker:
            hold_row(blocker, "s0")
            logs[0].append(commit(1, 1), durable=False)
            first = logs[0].sync_soon()  # the writer's statement waits for s0's row ...
            writer_waits_for_a_lock(dsn)
            futs = []
            for i, log in enumerate(logs[1:], start=1):  # ... while these queue
                log.append(InputRecord(turn=1, text=f"in{i}", seq=1), durable=False)
                futs.append(log.sync_soon())
                log.append(commit(1, 2), durable=False)
                futs.append(log.sync_soon())
            batches = store.writer.batches
            blocker.commit()
        results = await asyncio.gather(first, *futs, return_exceptions=True)
        assert store.writer.batches == batches + 2, "the queued commits went in one statement"
        return [r if isinstance(r, BaseException) else None for r in results]

    results = asyncio.run(main())
    fenced = results[1 + 2 * 2: 1 + 2 * 3]  # s3's input and commit
    assert all(isinstance(r, Fenced) for r in fenced), results
    assert [r for i, r in enumerate(results) if not 5 <= i <= 6] == [None] * 9, results
    for i in (1, 2, 4, 5):
        assert log_rows(dsn, f"s{i}")[1:] == [frame_record(InputRecord(turn=1, text=f"in{i}", seq=1)),
                                              frame_record(commit(1, 2))]
    assert log_rows(dsn, "s3")[1:] == []
    with pytest.raises(Fenced):  # and it stays refused, synchronously too
        logs[3].append(commit(2, 3), durable=True)
    logs[4].append(commit(2, 3), durable=True)  # the others go on
    assert len(log_rows(dsn, "s4")) == 4


@pytest.mark.component
def test_a_connection_killed_mid_batch_lands_each_commit_once(
    dsn: str, stores: list[PgStateStore], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PgStateStore(dsn)
    stores.append(store)
    logs = [store.create(meta(f"s{i}")) for i in range(4)]

    async def main() -> list[object]:
        # The writer's backend killed while its statement waits for a lock.
        with psycopg.connect(dsn) as blocker:
            hold_row(blocker, "s0")
            futs = []
            for log in logs:
                log.append(commit(1, 1), durable=False)
                futs.append(log.sync_soon())
            writer_waits_for_a_lock(dsn)
            (pid,), = sql(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = 'sessiond-commits'")
            sql(dsn, "SELECT pg_terminate_backend(%s)", pid)
            wait_for(lambda: not sql(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", pid), 10,
                     "the writer's backend to be gone, its statement with it")
            blocker.commit()
        first = await asyncio.gather(*futs, return_exceptions=True)
        # Then a statement that lands but whose reply is lost: the retry
        # finds every commit of it landed and writes none twice.
        real = pg_batch._commits
        calls = []

        def lands_then_link_drops(cur: psycopg.Cursor[object], entries: list[object]) -> object:
            out = real(cur, entries)  # type: ignore[arg-type]
            calls.append(len(entries))
            if len(calls) == 1:
                cur.connection.close()
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            return out

        monkeypatch.setattr(pg_batch, "_commits", lands_then_link_drops)
        futs = []
        for log in logs:
            log.append(commit(2, 2), durable=False)
            futs.append(log.sync_soon())
        second = await asyncio.gather(*futs, return_exceptions=True)
        return [*first, *second, len(calls)]

    *results, attempts = asyncio.run(main())
    assert results == [None] * 8, results
    assert attempts >= 2, "the lost reply was retried"
    for i in range(4):
        assert log_rows(dsn, f"s{i}")[1:] == [frame_record(commit(1, 1)), frame_record(commit(2, 2))]
    assert "PostgreSQL connection lost" in caplog.text


@pytest.mark.component
def test_a_server_stopped_mid_batch_fails_exactly_the_waiting_commits(
    pg_server: PgServer, dsn: str, stores: list[PgStateStore]
) -> None:
    store = PgStateStore(dsn, retry_secs=0.5)
    stores.append(store)
    a, b, c = (store.create(meta(sid)) for sid in "abc")
    a.append(commit(1, 1), durable=True)  # durable before: stays
    stopped = False

    async def main() -> list[BaseException | None]:
        nonlocal stopped
        blocker = psycopg.connect(dsn)
        try:
            hold_row(blocker, "a")
            futs = []
            for log in (a, b):
                log.append(commit(2, 2), durable=False)
                futs.append(log.sync_soon())
            writer_waits_for_a_lock(dsn)
            # Immediate: every backend quits at once, holding its locks.  (A
            # fast stop ends the blocker's backend, and with it the row lock,
            # while the writer's may still commit before it is ended too.)
            await asyncio.to_thread(pg_server.stop, "immediate")
            stopped = True
            c.append(commit(1, 1), durable=False)  # queued during the outage: it waited too
            futs.append(c.sync_soon())
            results = await asyncio.gather(*futs, return_exceptions=True)
        finally:
            blocker.close()
        return [r if isinstance(r, BaseException) else None for r in results]

    try:
        results = asyncio.run(main())
    finally:
        if stopped:
            pg_server.start()
    assert all(isinstance(r, StoreError) and "cannot be reached" in str(r) for r in results), results
    assert log_rows(dsn, "a")[1:] == [frame_record(commit(1, 1))]
    assert log_rows(dsn, "b")[1:] == [] and log_rows(dsn, "c")[1:] == []
    for log in (a, b, c):  # the failed ones were dropped; the next ones land after what is durable
        log.append(commit(3, 3), durable=True)
    assert log_rows(dsn, "a")[1:] == [frame_record(commit(1, 1)), frame_record(commit(3, 3))]
    assert log_rows(dsn, "b")[1:] == [frame_record(commit(3, 3))]


@pytest.mark.component
def test_a_server_out_of_space_fails_only_the_waiting_commits_with_store_full(
    dsn: str, stores: list[PgStateStore]
) -> None:
    store = PgStateStore(dsn)
    stores.append(store)
    a, b, z = store.create(meta("a")), store.create(meta("b")), store.create(meta("z"))
    a.append(commit(1, 1), durable=True)
    sql(dsn, "CREATE FUNCTION full_for_b() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
             "IF NEW.session = 'b' THEN RAISE EXCEPTION 'no space' USING ERRCODE = 'disk_full'; END IF; "
             "RETURN NEW; END $$")
    sql(dsn, "CREATE TRIGGER full_for_b BEFORE INSERT ON sessiond_records FOR EACH ROW "
             "EXECUTE FUNCTION full_for_b()")

    async def main() -> list[BaseException | None]:
        with psycopg.connect(dsn) as blocker:
            hold_row(blocker, "z")
            z.append(commit(1, 1), durable=False)
            futs = [z.sync_soon()]
            writer_waits_for_a_lock(dsn)
            for log in (a, b):  # queued: one statement for both
                log.append(commit(2, 2), durable=False)
                futs.append(log.sync_soon())
            blocker.commit()
        done = await asyncio.gather(*futs, return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in done]

    results = asyncio.run(main())
    # The statement failed as a whole; tried one by one, only b's fails.
    assert results[:2] == [None, None] and isinstance(results[2], StoreFull), results
    assert log_rows(dsn, "a")[1:] == [frame_record(commit(1, 1)), frame_record(commit(2, 2))]
    assert log_rows(dsn, "b")[1:] == []


# ---------------------------------------------------------------- schema


@pytest.mark.component
def test_the_schema_is_made_once_and_a_newer_one_is_refused(dsn: str, stores: list[PgStateStore]) -> None:
    stores += [PgStateStore(dsn), PgStateStore(dsn)]  # the second finds it made
    assert sql(dsn, "SELECT version FROM sessiond_schema") == [(SCHEMA_VERSION,)]
    sql(dsn, "UPDATE sessiond_schema SET version = version + 1")
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this"):
        PgStateStore(dsn)


@pytest.mark.pure
def test_the_dsn_is_logged_without_its_password() -> None:
    shown = safe_dsn("host=db.example dbname=s user=u password=hunter2")
    assert "hunter2" not in shown and "db.example" in shown


@pytest.mark.pure
def test_postgres_needs_a_dsn() -> None:
    with pytest.raises(ConfigError, match="'store.dsn' must be set"):
        parse_config({"store": {"backend": "postgres"}}, "c.toml")
    with pytest.raises(ConfigError, match="store.backend"):
        parse_config({"store": {"backend": "mysql"}}, "c.toml")
    assert parse_config({}, "c.toml").store.backend == "file"


# ---------------------------------------------------------------- a real daemon


def pg_config(dsn: str, worker: str = "") -> str:
    return (FAST_CONFIG.replace("[agent.worker]\n", f"[agent.worker]\n{worker}") + "\n"
            + tomli_w.dumps({"store": {"backend": "postgres", "dsn": dsn}}))


@pytest.mark.process
def test_a_daemon_on_postgres_loses_no_turn_to_a_worker_kill_or_its_own(make_daemon, dsn: str) -> None:
    d = make_daemon(pg_config(dsn, "snapshot_every_turns = 3\n"))
    with d.client() as c:
        sid = c.create().id
        for i in range(1, 5):
            assert c.send_text(sid, f"t{i}") == f"{i}: t{i}"
        pid = c.status(sid).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).restarts == 1, 10,
                 "the worker to restart from the store")
        assert c.send_text(sid, "t5") == "5: t5"
    d.kill()
    d.start()
    with d.client() as c:
        st = c.status(sid)
        assert st.state == "hibernated" and st.turns == 5
        assert c.send_text(sid, "t6") == "6: t6"
    assert "state in PostgreSQL" in d.log
    assert not list((d.state_dir / "sessions").glob("*")), "nothing of it in files"
    (gen, snapshot), = sql(dsn, "SELECT gen, snapshot IS NOT NULL FROM sessiond_sessions WHERE id = %s", sid)
    assert gen >= 2 and snapshot


@pytest.mark.process
def test_a_daemon_whose_database_cannot_be_reached_says_so(make_daemon, tmp_path) -> None:
    nowhere = tmp_path / "no-server-here"
    nowhere.mkdir()
    d = make_daemon(pg_config(f"host={nowhere} dbname=x password=hunter2")
                    .replace("[store]", "[store]\nretry_secs = 0.2"), start=False)
    with pytest.raises(AssertionError, match="exited with 1") as exc:
        d.start()
    assert "cannot be reached" in str(exc.value) and "hunter2" not in str(exc.value)


@pytest.mark.pure
def test_a_server_out_of_space_is_store_full() -> None:
    from psycopg import errors as pgerr

    from supervisor.store.postgres.store import _store_error
    from supervisor.errors import StoreFull

    full = _store_error("the log of s1", pgerr.DiskFull("could not extend file: No space left on device"))
    assert isinstance(full, StoreFull) and "out of space" in str(full)
    other = _store_error("the log of s1", pgerr.UniqueViolation("duplicate key"))
    assert type(other) is StoreError and "duplicate key" in str(other)


# ---------------------------------------------------------------- the loop never waits for the database


@pytest.mark.component
def test_a_create_snapshot_and_read_held_up_by_a_lock_leave_the_loop_free(
    dsn: str, stores: list[PgStateStore]
) -> None:
    store = PgStateStore(dsn)
    stores.append(store)
    old = store.create(meta("old"))
    old.append(commit(1, 1), durable=True)

    async def main() -> tuple[bytes, list[bytes], int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        beat = asyncio.create_task(ticker())
        with psycopg.connect(dsn) as blocker:
            # Writes of the session table wait; reads do not.
            blocker.execute(b"LOCK TABLE sessiond_sessions IN EXCLUSIVE MODE")
            new = store.create(meta("new"), durable=False)  # returns at once
            made = new.make_durable_soon()
            snap = old.write_snapshot_soon(Snapshot(gen=0, meta=meta("old"), turns=1, seq=1, handler_state=b"S"))
            read = old.read_for_boot_soon()  # after the snapshot, which it must see
            await asyncio.to_thread(writer_waits_for_a_lock, dsn)
            seen = ticks
            while ticks < seen + 20:  # the loop runs while the writer waits
                await asyncio.sleep(0.001)
            assert not (made.done() or snap.done() or read.done())
            blocker.commit()
        await asyncio.gather(made, snap)
        beat.cancel()
        return await read

    assert asyncio.run(main()) == (b"S", [], 1)
    assert store.ids() == ["new", "old"]


def _server_processes(pg_server: PgServer) -> list[psutil.Process]:
    postmaster = psutil.Process(int((pg_server.data / "postmaster.pid").read_text().split()[0]))
    return [postmaster, *postmaster.children()]


@pytest.mark.process
def test_the_daemon_answers_while_its_database_is_frozen_and_loses_nothing(
    make_daemon, pg_server: PgServer, dsn: str
) -> None:
    """The server stopped (SIGSTOP: it answers nothing, no connection
    breaks) while clients create a session, run a turn whose snapshot
    follows, and remove one: the daemon still answers pings and lists the
    new session as starting; once the server goes on, every one of them
    completes, and a restarted daemon finds exactly that."""
    d = make_daemon(pg_config(dsn, "snapshot_every_turns = 1\n"))
    with d.client() as c:
        busy, doomed = c.create().id, c.create().id
        assert c.send_text(busy, "a") == "1: a"
    outcomes: dict[str, object] = {}

    def client_call(name: str, call: Callable[[Client], object]) -> threading.Thread:
        def run() -> None:
            try:
                with d.client() as c:
                    outcomes[name] = call(c)
            except Exception as exc:  # noqa: BLE001 (handed to the test's thread)
                outcomes[name] = exc

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    stopped = _server_processes(pg_server)
    for proc in stopped:
        proc.send_signal(signal.SIGSTOP)
    try:
        threads = [client_call("create", lambda c: c.create().id),
                   client_call("turn", lambda c: c.send_text(busy, "b")),
                   client_call("rm", lambda c: c.remove(doomed))]
        with d.client() as c, ThreadPoolExecutor(1) as pool:
            def starting() -> bool:
                return any(s.state == "starting" for s in pool.submit(c.list).result(10))

            wait_for(starting, 10, "the new session to be listed as starting")
            pool.submit(c.ping).result(10)  # answered while the database answers nothing
        assert not outcomes, outcomes
    finally:
        for proc in stopped:
            proc.send_signal(signal.SIGCONT)
    for thread in threads:
        thread.join(30)
    new = outcomes["create"]
    assert isinstance(new, str), outcomes
    assert outcomes["turn"] == "2: b" and outcomes["rm"] is None, outcomes
    with d.client() as c:
        assert c.send_text(new, "c") == "1: c"
    snapshot, = sql(dsn, "SELECT snapshot IS NOT NULL FROM sessiond_sessions WHERE id = %s", busy)
    assert snapshot == (True,)
    d.kill()
    d.start()
    with d.client() as c:
        assert sorted(s.id for s in c.list()) == sorted([busy, new])
        assert c.status(busy).turns == 2 and c.status(new).turns == 1
        assert c.send_text(busy, "d") == "3: d"


@pytest.mark.process
def test_a_create_that_cannot_reach_the_database_fails_cleanly(make_daemon, pg_server: PgServer, dsn: str) -> None:
    d = make_daemon(pg_config(dsn) + "retry_secs = 0.3\n")
    with d.client() as c:
        kept = c.create().id
    pg_server.stop()
    try:
        with d.client() as c:
            with pytest.raises(RequestError, match="cannot be reached"):
                c.create()
            c.ping()
            assert [s.id for s in c.list()] == [kept]
    finally:
        pg_server.start()
    assert [r[0] for r in sql(dsn, "SELECT id FROM sessiond_sessions")] == [kept]
    with d.client() as c:
        assert c.send_text(kept, "a") == "1: a"


@pytest.mark.component
def test_a_snapshot_the_server_refuses_fails_alone_and_the_commits_around_it_land(
    dsn: str, stores: list[PgStateStore]
) -> None:
    store = PgStateStore(dsn)
    stores.append(store)
    h = store.create(meta())
    sql(dsn, "CREATE FUNCTION no_snapshots() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
             "RAISE EXCEPTION 'no space' USING ERRCODE = 'disk_full'; END $$")
    sql(dsn, "CREATE TRIGGER no_snapshots BEFORE UPDATE OF snapshot ON sessiond_sessions FOR EACH ROW "
             "EXECUTE FUNCTION no_snapshots()")

    async def main() -> list[BaseException | None]:
        h.append(commit(1, 1), durable=False)
        futs = [h.sync_soon(), h.write_snapshot_soon(Snapshot(gen=0, meta=meta(), turns=1, seq=1))]
        h.append(commit(2, 2), durable=False)
        futs.append(h.sync_soon())
        done = await asyncio.gather(*futs, return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in done]

    results = asyncio.run(main())
    assert results[0] is None and isinstance(results[1], StoreFull) and results[2] is None, results
    assert log_rows(dsn)[1:] == [frame_record(commit(1, 1)), frame_record(commit(2, 2))]
    assert sql(dsn, "SELECT snapshot IS NULL FROM sessiond_sessions") == [(True,)]


@pytest.mark.component
def test_daemons_sharing_the_database_learn_each_other_s_charges_to_a_uid(dsn: str,
                                                                       stores: list[PgStateStore]) -> None:
    """The spend ledger is one row per uid for every daemon on the
    database: a charge from one is answered with the uid's total, the
    other's charges included (supervisor.core.budgets keeps the larger)."""
    from supervisor.store.spend import Charge

    a, b = PgStateStore(dsn), PgStateStore(dsn)
    stores += [a, b]

    async def go() -> tuple[object, object]:
        first = await a.spend.write([Charge(session="on-a", uid=7, add={"llm_calls": 3}, turn=1)])
        second = await b.spend.write([Charge(session="on-b", uid=7, add={"llm_calls": 1}, turn=1)])
        return first, second

    first, second = asyncio.run(go())
    assert first is not None and first.uids[7] == {"llm_calls": 3}  # type: ignore[attr-defined]
    assert second is not None and second.uids[7] == {"llm_calls": 4}  # type: ignore[attr-defined]
    assert set(second.sessions) == {"on-b"}  # type: ignore[attr-defined]
    assert a.spend.read().uids[7] == {"llm_calls": 4}
