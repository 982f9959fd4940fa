"""A stall is blamed on whoever stalled (issue 23): the daemon's loop never
waits on the store when a worker dies (a PostgreSQL outage stalled it, and
`ping` with it), and a stall of the daemon's own loop is never taken for its
workers' silence (every live worker was killed with `killed_heartbeat` when
the loop came back).  Real daemons, real workers, the suite's real
PostgreSQL."""

from __future__ import annotations

import os
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
def test_a_stall_of_the_daemons_own_loop_is_not_blamed_on_its_workers(
    make_daemon, pg_server: PgServer, dsn: str  # noqa: F811
) -> None:
    """The loop blocked inside a callback (here: `history`, a read it still
    makes on its own database connection, while the database is stopped).
    When it comes back, the sweep's timer runs before the workers' sockets
    are read: it used to find every running worker silent and kill it."""
    d: Daemon = make_daemon(pg_config(dsn))
    with d.client() as c:
        sids = [c.create(handler="fixture_handlers:slow").id for _ in range(3)]
    threads, replies = _slow_turns(d, sids)
    postmaster = psutil.Process(int((pg_server.data / "postmaster.pid").read_text().split()[0]))

    def history() -> None:
        with d.client() as c:
            c.history(sids[0])

    def stall() -> None:
        t = threading.Thread(target=history)
        t.start()
        threads.append(t)

    _hold([postmaster, *postmaster.children()], stall)
    _healthy(d, sids, threads, replies)
    wait_for(lambda: "loop was stalled for" in d.log, 10, "the stall to be logged")


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
    assert os.path.exists(d.socket)
