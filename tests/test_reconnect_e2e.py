"""Clients outlive the daemon, against a real one: a turn in progress, the
daemon SIGKILLed and started again (it resumes the held turn by itself),
and each client (`sessionctl send`, the Python client, the Node client)
reconnects, attaches again from the last event it saw and ends with the
turn's real outcome: exit 0 and the whole reply.  Then what a client says
when the daemon does not come back (exit 3 after the wait, or Ctrl-C
during it: 130) and when it comes back without the session (4).  The
promises one by one, against a scripted socket: tests/test_client_reconnect.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from harness import REPO, Daemon, env_for_children, wait_for
from ipc import messages as m
from test_node_client import node

pytestmark = pytest.mark.process

HANDLER = "fixture_handlers:pause_once_steps"  # "a", then a step that waits on its first run, then "b"

# Node, as an application would: the turn's events as JSON lines.
_NODE_SEND = """
import { Client } from './sessiond.mjs';
const [path, session] = process.argv.slice(1);
const client = await Client.connect(path, { reconnectSecs: 30, onReconnect: (l) => console.error(l) });
for await (const ev of client.send(session, 'hi')) console.log(JSON.stringify(ev));
client.close();
"""


class Lines:
    """A child's pipe read line by line with deadlines."""

    def __init__(self, pipe: Any) -> None:
        self.fd = pipe.fileno()
        self.buf = b""

    def until(self, needle: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        while needle.encode() not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {needle!r} within {timeout}s; got {self.buf!r}")
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise AssertionError(f"the pipe ended before {needle!r}; got {self.buf!r}")
                self.buf += chunk
        return self.buf.decode()

    def rest(self, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> tuple[str, bytes]:
        """Everything it wrote there once it ended, and its stderr."""
        out, err = proc.communicate(timeout=timeout)
        return (self.buf + out).decode(), err


def _ctl(d: Daemon, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), *args],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env_for_children())


def test_send_from_sessionctl_python_and_node_outlives_a_daemon_sigkill(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sids = [c.create(handler=HANDLER).id for _ in range(3)]
    ctl = _ctl(d, "send", sids[0], "hi")
    nodejs = subprocess.Popen([node(), "--input-type=module", "-e", _NODE_SEND, str(d.socket), sids[2]],
                              cwd=REPO / "clients" / "node", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    events: list[Any] = []
    failure: list[BaseException] = []
    started = threading.Event()

    def python_send() -> None:
        from supervisor.ctl.client import Client

        try:
            with Client(d.socket, reconnect_secs=30) as client:
                for ev in client.send(sids[1], "hi"):
                    events.append(ev)
                    if isinstance(ev, m.TextDelta):
                        started.set()
        except BaseException as exc:  # (to the test's thread)
            failure.append(exc)
            started.set()

    py = threading.Thread(target=python_send)
    py.start()
    ctl_out, node_out = Lines(ctl.stdout), Lines(nodejs.stdout)
    try:
        # Each turn is past step "a" and in the step that waits: SIGKILL.
        ctl_out.until("after a")
        node_out.until("after a")
        assert started.wait(15) and not failure, failure
        d.kill()
        d.start()
        # sessionctl: one turn, exit 0, the whole reply.
        out, err = ctl_out.rest(ctl)
        assert ctl.returncode == 0, err
        assert out.rstrip().endswith("1: AB hi"), out
        assert b"reconnected to sessiond" in err and b"turn resumed" in err
        # The Python client: the same turn's events, ending with its TurnDone.
        py.join(30)
        assert not failure, failure
        done = events[-1]
        assert isinstance(done, m.TurnDone) and done.turn == 1 and done.reply == "1: AB hi" and done.seq > 0
        assert any(isinstance(e, m.Notice) and e.kind == "turn_resumed" for e in events)
        # Node: the same.
        out, node_err = node_out.rest(nodejs)
        assert nodejs.returncode == 0, node_err
        node_events = [json.loads(line) for line in out.splitlines()]
        assert node_events[-1]["type"] == "turn_done" and node_events[-1]["reply"] == "1: AB hi"
        assert b"reconnected to sessiond" in node_err
    finally:
        for p in (ctl, nodejs):
            p.kill()
        py.join(5)
    with d.client() as c:  # one turn each, not two: nothing was sent again
        assert [c.status(sid).turns for sid in sids] == [1, 1, 1]


def test_a_daemon_that_does_not_come_back_and_ctrl_c_during_the_wait(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        waiting, bounded = c.create(handler=HANDLER).id, c.create(handler=HANDLER).id
    ctl = _ctl(d, "send", waiting, "hi")
    short = _ctl(d, "send", bounded, "hi", "--reconnect-secs", "0.5")
    try:
        Lines(ctl.stdout).until("after a")
        Lines(short.stdout).until("after a")
        d.kill()
        # Not coming back: after the wait, exit 3 saying so.
        _, err = short.communicate(timeout=30)
        assert short.returncode == 3, err
        assert b"did not come back within 0.5s" in err and f"turn 1 of {bounded} goes on".encode() in err
        # Ctrl-C while waiting: stop waiting (nothing to interrupt through), 130.
        Lines(ctl.stderr).until("reconnecting for up to 30s")
        ctl.send_signal(signal.SIGINT)
        _, err = ctl.communicate(timeout=15)
        assert ctl.returncode == 130, err
        assert b"stopped waiting for sessiond" in err
    finally:
        ctl.kill()
        short.kill()


def test_attach_follows_across_a_restart_and_a_session_gone_is_exit_4(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        kept, gone = c.create(handler="echo").id, c.create(handler="echo").id
        c.send_text(kept, "one")
        after, gone_after = c.status(kept).seq, c.status(gone).seq
    # From the next seq: a turn's events reach each even if it subscribes
    # after they were sent; once each has printed its turn it is attached.
    follow = _ctl(d, "attach", kept, "--from", str(after + 1))
    lost = _ctl(d, "attach", gone, "--from", str(gone_after + 1))
    try:
        out = Lines(follow.stdout)
        assert d.ctl("send", kept, "two").returncode == 0
        out.until("turn 2 done")
        assert d.ctl("send", gone, "only").returncode == 0
        Lines(lost.stdout).until("turn 1 done")
        d.kill()
        shutil.rmtree(d.state_dir / "sessions" / gone)  # gone when the daemon comes back
        d.start()
        _, err = lost.communicate(timeout=30)
        assert lost.returncode == 4 and b"no session" in err, err
        assert d.ctl("send", kept, "three").returncode == 0
        out.until("turn 3 done")  # the same attach, after the restart
        assert d.ctl("rm", kept).returncode == 0
        follow.communicate(timeout=15)
        assert follow.returncode == 0  # the session deleted: the one quiet end
    finally:
        follow.kill()
        lost.kill()
