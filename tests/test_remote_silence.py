"""A remote worker's missed heartbeats are blamed on whoever was silent
(supervisor.core.silence): the front asks the worker's node host before it
kills the worker.  The finding (a `make test` run on 2 busy cores): a node
host's loop held up for about a second, while its worker beat on time,
got a healthy worker killed as `killed_heartbeat: ... its event loop is
stuck`, and the turn resumed on a story that was not so.  In-process: the
core over a spawner whose workers are "remote" (tests/fakespawner.py), and
the node host's answer over a real socketpair, no Ray.  The same over a
real Ray cluster: tests/test_cluster.py."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from fakespawner import FakeRemoteSpawner
from ipc import messages as m
from supervisor.cluster.nodehost import NodeHost, _Worker, checked_silence
from supervisor.config import parse_config
from supervisor.core.manager import SessionManager
from supervisor.core.session import Session
from supervisor.store.memory import InMemoryStateStore
from test_core_component import Recorder
from polling import until

pytestmark = pytest.mark.component

CONFIG = {"agent": {"worker": {"heartbeat_interval_secs": 0.05, "restart_backoff_initial_ms": 1},
                    "limits": {"memory_poll_interval_ms": 10}},
          "tools": {"disk_quota": "measured"}}  # no workspace image per session


def _silent_turn(tmp_path: Path, body: Callable[[SessionManager, FakeRemoteSpawner, Session, Recorder],
                                                 Awaitable[None]]) -> None:
    """A session whose worker runs a turn and sends no heartbeat at all
    (what the front hears of it is held up), with the sweep running."""
    spawner = FakeRemoteSpawner()
    mgr = SessionManager(parse_config(CONFIG, "test"), tmp_path, spawner, store=InMemoryStateStore())
    mgr.load_all()

    async def run() -> None:
        session = await mgr.create(1000, "s", "echo", {})
        watcher = Recorder()
        mgr.attach(session, watcher, None)
        assert session.worker is not None
        spawner.workers[session.worker.pid].behaviour = lambda w, msg: isinstance(msg, m.Input)  # runs on
        await mgr.send(session, "a long turn", None)
        sweep = asyncio.ensure_future(mgr.sweeper.run())
        try:
            await body(mgr, spawner, session, watcher)
        finally:
            sweep.cancel()

    asyncio.run(asyncio.wait_for(run(), 20))




def test_a_remote_worker_its_node_host_hears_is_not_killed_for_a_delay_on_the_way(tmp_path: Path) -> None:
    async def body(mgr: SessionManager, spawner: FakeRemoteSpawner, session: Session, watcher: Recorder) -> None:
        worker = session.worker
        assert worker is not None
        # Its node host heard from it just now, each time it is asked.
        await until(lambda: len(spawner.asked) >= 3 or session.last_exit is not None,
                     "three questions (allowances of 0.15 s), or a kill")
        assert session.last_exit is None and session.worker is worker, session.last_exit
        assert not [e for e in watcher.of(m.LimitExceeded) if e.kind == "heartbeat"]
        # Silent where it runs too: stuck, and told so.
        spawner.answer = lambda pid: 10.0
        await until(lambda: session.last_exit is not None, "the kill")
        assert session.last_exit is not None and session.last_exit.reason == "killed_heartbeat"
        assert "nothing from it on its node for 10.0s: its event loop is stuck" in session.last_exit.detail
        assert [e.kind for e in watcher.of(m.LimitExceeded)] == ["heartbeat"]

    _silent_turn(tmp_path, body)


def test_a_remote_worker_lost_with_its_node_is_told_as_the_node_s_loss_not_as_missed_heartbeats(
        tmp_path: Path) -> None:
    async def body(mgr: SessionManager, spawner: FakeRemoteSpawner, session: Session, watcher: Recorder) -> None:
        def lost(pid: int) -> None:  # the node host cannot be reached: the spawner says the node is lost
            spawner.on_worker_lost(pid, "node_lost: lost the node host on 10.0.0.7 (ActorDiedError)")

        spawner.answer = lost  # type: ignore[assignment,return-value]
        await until(lambda: watcher.of(m.TurnFailed), "the turn to fail")
        assert watcher.of(m.TurnFailed)[0].reason.startswith("node_lost: lost the node host on 10.0.0.7")
        assert session.last_exit is not None and session.last_exit.reason == "node_lost"
        # The client was never told of missed heartbeats: the node was lost.
        assert not watcher.of(m.LimitExceeded)

    _silent_turn(tmp_path, body)


# A worker's pid no process has (pid_max is at most 2**22): the host reads
# nothing of this machine's processes for it (its scheduler statistics).
PID = 2**22 + 7


def _host_with_a_worker() -> tuple[NodeHost, _Worker, asyncio.Future[Any], socket.socket, socket.socket]:
    """A node host holding worker PID over a socketpair: (host, worker,
    its exit, the host's end, the worker's end)."""
    host = NodeHost()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    exit_: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    worker = host._workers[PID] = _Worker(ours, exit_, "front", claimed=True)
    return host, worker, exit_, ours, theirs


def test_a_node_host_says_how_long_a_worker_has_been_silent_there() -> None:
    async def body() -> None:
        host, worker, exit_, ours, theirs = _host_with_a_worker()
        try:
            worker.heard -= 10.0  # it last wrote ten seconds ago
            assert 10.0 <= (await host.silent_for(PID) or 0.0) < 60.0
            theirs.send(b"beat")  # it wrote; the host's loop has not read it yet (held up)
            assert await host.silent_for(PID) == 0.0
            assert ours.recv(16) == b"beat"  # (peeked, not taken)
            assert await host.silent_for(PID + 1) is None  # no such worker
            exit_.set_result((None, 9, ""))
            assert await host.silent_for(PID) is None  # gone: its exit is on the stream
        finally:
            ours.close()
            theirs.close()

    asyncio.run(body())


def test_bytes_the_loop_took_but_has_not_yet_marked_count_as_heard() -> None:
    """The finding (a clean-clone `make test` at load 3.6): a node host let
    go after a stall answered "nothing from it on its node for 1.6s" for a
    worker that had beaten on time.  The loop's read callback had taken the
    beats from the socket in the same pass (nothing left to peek at) and
    `_read`, which marks the worker heard, had not run yet."""
    async def body() -> None:
        host, worker, exit_, ours, theirs = _host_with_a_worker()
        out: asyncio.Queue[Any] = asyncio.Queue()
        reading = asyncio.get_running_loop().create_task(host._read(PID, worker, out))
        try:
            await asyncio.sleep(0)  # `_read` waits in sock_recv
            worker.heard -= 10.0  # it last wrote ten seconds ago, then the host stalled
            theirs.send(b"beat")
            # Next pass: the read callback takes the bytes and wakes `_read`
            # for the pass after, where this question comes first.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert not _peekable(ours) and time.monotonic() - worker.heard > 9.0  # taken, not yet marked
            silent = await host.silent_for(PID)
            assert silent is not None and silent < 1.0, silent
            assert await out.get() == b"beat"
        finally:
            reading.cancel()
            ours.close()
            theirs.close()

    asyncio.run(body())


def _peekable(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def test_what_a_front_takes_of_a_node_host_s_answer() -> None:
    assert checked_silence(None) is None
    assert checked_silence(1.5) == 1.5 and checked_silence(0) == 0.0
    for bad in (True, -1.0, math.nan, math.inf, "1", [1]):
        assert checked_silence(bad) == math.inf, bad  # the front's own figure stands
