"""A booted worker waits for its first input without an event loop.

Real workers forked from this process (no loop, no thread here, as in the
zygote), driven over a socketpair: what the idle phase must still do
(pings, heartbeats, stop), that the loop really is built only at the first
input, and that the hand-over loses nothing (state restored at Boot,
frames sent together with the first input)."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from forked_worker import ForkedWorker
from harness import wait_for
from ipc import messages as m
from ipc.contract import EXIT_BOOT_FAILED
from ipc.framing import encode_frame
from ipc.settings import SessionSettings

pytestmark = pytest.mark.process

_enc = msgspec.msgpack.Encoder()


class Child(ForkedWorker):
    def __init__(self, boot: m.Boot) -> None:
        super().__init__()
        self.send(boot)

    def recv_until(self, kind: type[Any]) -> Any:
        while not isinstance(msg := self.recv(), kind):
            pass
        return msg

    def has_event_loop(self) -> bool:
        """uvloop and the stdlib loop both poll with an epoll instance."""
        fds = Path(f"/proc/{self.pid}/fd")
        return any(os.readlink(fd) == "anon_inode:[eventpoll]" for fd in fds.iterdir())



def _boot(workspace: Path, handler: str = "echo", heartbeat_secs: float = 1.0,
          snapshot: Any = None, records: list[Any] | None = None) -> m.Boot:
    settings = SessionSettings()
    settings.agent.worker.heartbeat_interval_secs = heartbeat_secs
    return m.Boot(
        session="idle", handler=handler, settings=_enc.encode(settings), workspace=str(workspace),
        snapshot=_enc.encode(snapshot) if snapshot is not None else b"",
        records=[_enc.encode(r) for r in records or []],
    )


@pytest.fixture
def child_factory(tmp_path: Path) -> Iterator[Any]:
    children: list[Child] = []

    def make(**kw: Any) -> Child:
        child = Child(_boot(tmp_path / "ws", **kw))
        children.append(child)
        return child

    yield make
    for child in children:
        child.close()


def test_idle_worker_pings_and_beats_with_no_event_loop(child_factory: Any) -> None:
    # Idle beats come every 30 intervals: 0.05 s -> one per 1.5 s.
    w = child_factory(heartbeat_secs=0.05)
    assert isinstance(w.recv(), m.Ready)
    w.send(m.WorkerPing(nonce=7))
    assert w.recv() == m.WorkerPong(nonce=7)
    assert isinstance(w.recv(), m.Heartbeat)
    w.send(m.Reconfigure(settings=_enc.encode(SessionSettings())), m.MemoryHigh(rss_bytes=1, limit_bytes=2),
           m.InterruptTurn(turn=1), m.WorkerPing(nonce=8))
    assert w.recv_until(m.WorkerPong) == m.WorkerPong(nonce=8)
    assert not w.has_event_loop()
    w.send(m.Input(turn=1, text="hi"))
    done = w.recv_until(m.Done)
    assert done.reply == "1: hi"
    assert w.has_event_loop()


def test_first_input_sees_the_restored_state_and_the_frames_sent_with_it(child_factory: Any) -> None:
    w = child_factory(snapshot=3, records=[1, 1])
    assert isinstance(w.recv(), m.Ready)
    # In one write: the idle phase reads the Input; the loop's transport
    # must still get the Ping behind it.
    w.send(m.Input(turn=6, text="hi"), m.WorkerPing(nonce=9))
    got: list[Any] = []
    while not (m.WorkerPong(nonce=9) in got and any(isinstance(msg, m.Done) for msg in got)):
        got.append(w.recv())  # (times out if one never comes)
    done = next(msg for msg in got if isinstance(msg, m.Done))
    assert done.reply == "6: hi"  # 3 from the snapshot, 2 records, then this turn


@pytest.mark.parametrize("how", ["sigterm", "shutdown", "hang-up"])
def test_idle_worker_stops_at_once(child_factory: Any, how: str) -> None:
    w = child_factory(heartbeat_secs=60.0)  # the next beat would be 30 min away
    assert isinstance(w.recv(), m.Ready)
    if how == "sigterm":
        os.kill(w.pid, signal.SIGTERM)
    elif how == "shutdown":
        w.send(m.Shutdown())
    else:
        w.sock.shutdown(socket.SHUT_WR)
    wait_for(w.exited, 5, "the idle worker to exit")
    assert w.status is not None and os.WIFEXITED(w.status) and os.WEXITSTATUS(w.status) == 0


def test_a_handler_that_cannot_be_built_still_fails_the_boot(child_factory: Any) -> None:
    w = child_factory(handler="fixture_handlers:crash_at_boot")
    failed = w.recv()
    assert isinstance(failed, m.BootFailed) and "this handler cannot start" in failed.reason
    wait_for(w.exited, 5, "the worker to exit")
    assert w.status is not None and os.WEXITSTATUS(w.status) == EXIT_BOOT_FAILED
