"""A stall is blamed on whoever stalled (issue 23): the daemon's loop never
waits on the store when a worker dies (a PostgreSQL outage stalled it, and
`ping` with it), and a stall of the daemon's own loop is never taken for its
workers' silence (every live worker was killed with `killed_heartbeat` when
the loop came back).  Real daemons, real workers, the suite's real
PostgreSQL stopped with SIGSTOP (it answers nothing, no connection breaks);
and the sweep's discount of a stall, in-process, deterministically."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from harness import Daemon, wait_for
from pg_server import PgServer
from test_pg_store import dsn, pg_config  # noqa: F401 (the fixture)

TICKS = 150  # a slow turn: TICKS deltas 20 ms apart (tests/fixture_handlers.py)
WHOLE = "".join(f"tick {i}\n" for i in range(TICKS))
# How long an outage or a stall lasts: several times a running worker's
# heartbeat allowance (3 x 0.2 s in FAST_CONFIG), well within a slow turn.
STALL_SECS = 2.0


def _slow_turns(d: Daemon, sids: list[str]) -> tuple[list[threading.Thread], dict[str, object]]:
    """A slow turn on each session, each from a client of its own; returns
    once every one is running."""
    replies: dict[str, object] = {}

    def run(sid: str) -> None:
        try:
            with d.client() as c:
                replies[sid] = c.send_text(sid, str(TICKS))
        except Exception as exc:  # noqa: BLE001 (handed to the test's thread)
            replies[sid] = exc

    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    with d.client() as c:
        wait_for(lambda: all(c.status(s).state == "running" for s in sids), 10, "the slow turns to run")
    return threads, replies


def _healthy(d: Daemon, sids: list[str], threads: list[threading.Thread], replies: dict[str, object]) -> None:
    for t in threads:
        t.join(60)
    assert all(replies.get(s) == WHOLE for s in sids), {s: str(replies.get(s))[:200] for s in sids}
    with d.client() as c:
        for sid in sids:
            st = c.status(sid)
            assert st.restarts == 0 and st.last_exit is None, (sid, st.last_exit)
    assert "killed_heartbeat" not in d.log


def _hold(procs: list[psutil.Process], during: Callable[[], None]) -> None:
    """SIGSTOP `procs` for STALL_SECS (the outage), running `during` in it."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    began = time.monotonic()
    try:
        during()
        left = STALL_SECS - (time.monotonic() - began)
        if left > 0:
            time.sleep(left)  # the outage's length is the test's input, not a wait for an event
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)


@pytest.mark.process
def test_history_during_a_database_outage_stalls_nothing(
    make_daemon, pg_server: PgServer, dsn: str  # noqa: F811
) -> None:
    """`history` read the database on the loop's own connection: with the
    database stopped, the whole daemon stopped answering, and when it came
    back every running worker was found silent and killed."""
    d: Daemon = make_daemon(pg_config(dsn))
    with d.client() as c:
        sids = [c.create(handler="fixture_handlers:slow").id for _ in range(3)]
        assert c.send_text(sids[0], "2") == "tick 0\ntick 1\n"
    threads, replies = _slow_turns(d, sids)
    postmaster = psutil.Process(int((pg_server.data / "postmaster.pid").read_text().split()[0]))
    read: dict[str, object] = {}

    def history() -> None:
        with d.client() as c:
            read["history"] = c.history(sids[0])

    def read_and_ping() -> None:
        t = threading.Thread(target=history)
        t.start()
        threads.append(t)
        with d.client() as c, ThreadPoolExecutor(1) as pool:
            for _ in range(3):  # answered while the history read waits for the database
                pool.submit(c.ping).result(STALL_SECS + 5)
        assert not read

    _hold([postmaster, *postmaster.children()], read_and_ping)
    _healthy(d, sids, threads, replies)
    assert read["history"].turns[0].reply == "tick 0\ntick 1\n"  # type: ignore[attr-defined]


@pytest.mark.process
def test_a_worker_dying_in_a_database_outage_stalls_nothing_and_kills_no_healthy_worker(
    make_daemon, pg_server: PgServer, dsn: str  # noqa: F811
) -> None:
    d: Daemon = make_daemon(pg_config(dsn))
    with d.client() as c:
        crasher = c.create(handler="fixture_handlers:crash_mid_turn").id
        assert c.send_text(crasher, "a") == "1: a"
        sids = [c.create(handler="fixture_handlers:slow").id for _ in range(3)]
        crasher_pid = c.status(crasher).pid
    assert crasher_pid is not None
    threads, replies = _slow_turns(d, sids)
    postmaster = psutil.Process(int((pg_server.data / "postmaster.pid").read_text().split()[0]))
    crashed: dict[str, object] = {}

    def crash_and_ping() -> None:
        def crash() -> None:
            try:
                with d.client() as c:
                    crashed["reply"] = c.send_text(crasher, "crash")
            except Exception as exc:  # noqa: BLE001
                crashed["reply"] = exc

        t = threading.Thread(target=crash)
        t.start()
        threads.append(t)
        wait_for(lambda: not psutil.pid_exists(crasher_pid), 10, "the worker to die mid-turn")
        with d.client() as c, ThreadPoolExecutor(1) as pool:
            # Answered while the database answers nothing (it stalled ~5 s per outage).
            pool.submit(c.ping).result(STALL_SECS + 5)

    _hold([postmaster, *postmaster.children()], crash_and_ping)
    _healthy(d, sids, threads, replies)
    with d.client() as c:
        wait_for(lambda: c.status(crasher).state == "idle", 30, "the crashed session to restart")
        assert c.send_text(crasher, "b") == "2: b"


@pytest.mark.process
def test_turns_that_end_during_a_database_outage_kill_no_worker(
    make_daemon, pg_server: PgServer, dsn: str  # noqa: F811
) -> None:
    """Once a worker sends Done its turn is over for it, and it beats 30x
    more slowly; the daemon judged it at the running pace until the
    commit's flush came back, so every turn that ended while the database
    answered nothing cost its worker (killed_heartbeat, 13-20 workers per
    8 s freeze in a chaos run, issue 32)."""
    d: Daemon = make_daemon(pg_config(dsn))
    with d.client() as c:
        sids = [c.create(handler="echo").id for _ in range(3)]
    postmaster = psutil.Process(int((pg_server.data / "postmaster.pid").read_text().split()[0]))
    replies: dict[str, object] = {}
    threads: list[threading.Thread] = []

    def turns_in_the_outage() -> None:
        def run(sid: str) -> None:
            try:
                with d.client() as c:
                    replies[sid] = c.send_text(sid, "in the outage")
            except Exception as exc:  # noqa: BLE001 (handed to the test's thread)
                replies[sid] = exc

        threads.extend(threading.Thread(target=run, args=(sid,)) for sid in sids)
        for t in threads:
            t.start()
        with d.client() as c:  # the echo turns are done, their commits wait for the database
            wait_for(lambda: all(c.status(s).state == "running" for s in sids), 10, "the turns")

    _hold([postmaster, *postmaster.children()], turns_in_the_outage)
    for t in threads:
        t.join(60)
    assert all(replies.get(s) == "1: in the outage" for s in sids), replies
    with d.client() as c:
        for sid in sids:
            st = c.status(sid)
            assert st.state == "idle" and st.restarts == 0 and st.last_exit is None, (sid, st.last_exit)
    assert "killed_heartbeat" not in d.log


@pytest.mark.component
def test_the_sweep_discounts_a_stall_of_its_own_loop(tmp_path) -> None:
    """In-process (the core over the in-process spawner): a healthy worker
    beats every 20 ms from a task of the same loop; the loop is then blocked
    (past twice the worker's allowance) inside a callback, as a store call
    on the loop blocks it.  When it runs again, the sweep's wake-up and the worker's next beat are
    due together: the sweep used to run first and kill the worker."""
    import asyncio

    from fakespawner import FakeSpawner
    from ipc import messages as m
    from supervisor.config import parse_config
    from supervisor.core.manager import SessionManager
    from supervisor.store.memory import InMemoryStateStore

    config = {"agent": {"worker": {"heartbeat_interval_secs": 0.05},
                        "limits": {"memory_poll_interval_ms": 10}},
              "tools": {"disk_quota": "measured"}}  # no workspace image per session
    spawner = FakeSpawner()
    mgr = SessionManager(parse_config(config, "test"), tmp_path, spawner, store=InMemoryStateStore())
    mgr.load_all()

    async def body() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        assert session.worker is not None
        worker = spawner.workers[session.worker.pid]
        worker.behaviour = lambda w, msg: isinstance(msg, m.Input)  # the turn runs on, never done
        await mgr.send(session, "a long turn", None)

        async def beat() -> None:
            while True:
                worker.send(m.Heartbeat())
                await asyncio.sleep(0.02)

        beats = asyncio.ensure_future(beat())
        sweep = asyncio.ensure_future(mgr.sweeper.run())
        for _ in range(20):  # the sweep runs and finds it healthy
            await asyncio.sleep(0.01)
        assert session.last_exit is None
        # The loop blocked for 0.4 s: well past the worker's allowance mid-turn
        # (HEARTBEATS_MISSED x 0.05 s = 0.15 s), which is all the old sweep needed.
        asyncio.get_running_loop().call_soon(time.sleep, 0.4)
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert session.last_exit is None and session.restarts == 0, session.last_exit
        assert mgr.sweeper.loop_stalls >= 1  # it was seen, and excused
        beats.cancel()
        sweep.cancel()

    asyncio.run(asyncio.wait_for(body(), 20))


@pytest.mark.process
def test_turns_that_end_while_the_disk_is_slow_to_flush_kill_no_worker(make_daemon, monkeypatch) -> None:
    """The file store's half of the above (issue 32: with every flush
    delayed 4 s, 15 of 15 workers were killed after their turns).  Every
    fdatasync of the daemon's store takes STALL_SECS, several times a
    running worker's heartbeat allowance (the delay bench/load.py gives a
    slow disk: SESSIOND_BENCH_FSYNC_DELAY_MS)."""
    monkeypatch.setenv("SESSIOND_BENCH_FSYNC_DELAY_MS", str(int(STALL_SECS * 1000)))
    d: Daemon = make_daemon()
    with ThreadPoolExecutor(3) as pool:
        def create(_: int) -> str:
            with d.client() as c:
                return c.create(handler="echo").id

        sids = list(pool.map(create, range(3)))

        def turn(sid: str) -> str:
            with d.client() as c:
                return c.send_text(sid, "on a slow disk")

        assert list(pool.map(turn, sids)) == ["1: on a slow disk"] * 3
    with d.client() as c:
        for sid in sids:
            st = c.status(sid)
            assert st.state == "idle" and st.restarts == 0 and st.last_exit is None, (sid, st.last_exit)
    assert "killed_heartbeat" not in d.log
