"""What a new user sees through `sessionctl`, against a real daemon: replies
that were not streamed, Ctrl-C, tool calls, permission prompts, exit codes,
--version and --help."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import FAST_CONFIG
from harness import Daemon, env_for_children, wait_for

pytestmark = pytest.mark.process

OPERATOR_CONFIG = FAST_CONFIG + """
[agent]
allowed_handlers = ["agent", "echo", "fixture_handlers:*", "operator_handlers:*"]
"""


@pytest.fixture
def opd(make_daemon) -> Daemon:
    return make_daemon(OPERATOR_CONFIG)


def _create(d: Daemon, handler: str) -> str:
    r = d.ctl("create", "--handler", handler)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_send_prints_a_reply_that_was_not_streamed(opd: Daemon) -> None:
    # docs/agent.md's Counter: streams "counting… ", returns the reply unstreamed.
    sid = _create(opd, "operator_handlers:counter")
    r = opd.ctl("send", sid, "hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "counting… \n5 characters, turn 1\n"
    # Nothing streamed at all: the reply alone.
    sid = _create(opd, "operator_handlers:silent")
    r = opd.ctl("send", sid, "x")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "silent reply to x\n"
    # A reply that was streamed whole is printed once, not twice.
    sid = _create(opd, "echo")
    r = opd.ctl("send", sid, "hi")
    assert r.stdout == "1: hi\n"


def _ctl_process(d: Daemon, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor.ctl", "--socket", str(d.socket), *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env_for_children(),
    )


def _read_until(pipe: object, needle: str, timeout: float = 10.0) -> str:
    """Read a child's pipe until `needle` shows up, within a deadline."""
    fd = pipe.fileno()  # type: ignore[attr-defined]
    buf = b""
    deadline = time.monotonic() + timeout
    while needle.encode() not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {needle!r} within {timeout}s; got {buf!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"end of output before {needle!r}; got {buf!r}")
            buf += chunk
    return buf.decode()


def test_ctrl_c_on_send_interrupts_the_turn(opd: Daemon) -> None:
    sid = _create(opd, "fixture_handlers:slow")
    proc = _ctl_process(opd, "send", sid, "100000")  # ~30 minutes of ticks
    try:
        _read_until(proc.stdout, "tick 1\n")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert b"interrupting the turn" in err and b"the turn was interrupted" in err
    # The partial reply was kept and the session is idle again, at once:
    # the turn did not go on running after the user pressed Ctrl-C.
    with opd.client() as c:
        wait_for(lambda: c.status(sid).state == "idle", 3.0, "the session to be idle")
        assert c.status(sid).turns == 1


def test_second_ctrl_c_detaches_from_a_turn_that_ignores_the_interrupt(opd: Daemon) -> None:
    sid = _create(opd, "fixture_handlers:deaf")
    proc = _ctl_process(opd, "send", sid, "x")
    try:
        _read_until(proc.stdout, "not listening")
        proc.send_signal(signal.SIGINT)
        _read_until(proc.stderr, "Ctrl-C again to detach")
        assert proc.poll() is None, "the first Ctrl-C must not leave the command"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"detached" in err and f"sessionctl interrupt {sid}".encode() in err


def test_send_shows_tool_calls_and_the_whole_permission_request(opd: Daemon) -> None:
    import re

    sid = _create(opd, "operator_handlers:tool_user")
    proc = _ctl_process(opd, "send", sid, "rm -rf build")
    try:
        err = _read_until(proc.stderr, "answer with")
        # The call is shown as it starts, and the prompt names the command.
        assert '[tool] bash {"command": "rm -rf build"}' in err
        found = re.search(r"permission request (\S+): bash \{\"command\": \"rm -rf build\"\}", err)
        assert found, err
        approve = opd.ctl("approve", sid, found.group(1))
        assert approve.returncode == 0, approve.stderr
        out, rest = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "[tool] bash ok: file-a (+1 line)" in rest.decode()
    assert out == b"done\n"  # stdout is the reply alone


def test_exit_codes_follow_the_contract(opd: Daemon) -> None:
    # Usage (2): the command line is wrong, whichever side finds it.
    for args, says in (
        (["--set", "agent.limits.nonsense=1"], "agent.limits.nonsense"),
        (["--set", "agent.max_turns=-3"], "agent.max_turns"),
        (["--handler", "nocolon"], "invalid handler"),
        (["--id", "../etc"], "invalid session id"),
    ):
        r = opd.ctl("create", *args)
        assert r.returncode == 2 and says in r.stderr, (args, r.returncode, r.stderr)
    # The session exists, the request does not: the operation failed (1).
    sid = _create(opd, "echo")
    for verb in ("approve", "deny"):
        r = opd.ctl(verb, sid, "bogus")
        assert r.returncode == 1 and "bogus" in r.stderr, r.stderr
        # No such session at all: 4.
        assert opd.ctl(verb, "nosuch", "bogus").returncode == 4


def test_attach_exits_3_when_the_daemon_dies(opd: Daemon) -> None:
    # (With no wait for it to come back; the wait: tests/test_reconnect_e2e.py.)
    sid = _create(opd, "echo")
    assert opd.ctl("send", sid, "hi").returncode == 0
    proc = _ctl_process(opd, "attach", sid, "--from", "0", "--reconnect-secs", "0")
    try:
        _read_until(proc.stdout, "turn 1 done")
        opd.kill()
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 3 and b"lost" in err, err
    # Deleting the session is the one quiet end of an attach: 0.
    opd.start()
    sid = _create(opd, "echo")
    proc = _ctl_process(opd, "attach", sid)
    try:
        # Sends until the attach shows a turn: then it is surely attached.
        wait_for(lambda: opd.ctl("send", sid, "x").returncode == 0
                 and b"done" in _peek(proc.stdout), 10.0, "the attach to see a turn")
        assert opd.ctl("rm", sid).returncode == 0
        proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0


def _peek(pipe: object) -> bytes:
    """Whatever a child has written so far, without blocking."""
    fd = pipe.fileno()  # type: ignore[attr-defined]
    ready, _, _ = select.select([fd], [], [], 0)
    return os.read(fd, 65536) if ready else b""


def test_a_waiting_session_shows_everywhere_and_approve_takes_the_session_alone(opd: Daemon) -> None:
    """`ls`, `status` (text and JSON, both paths), `top` and a plain
    `attach` show the request a turn waits on; `approve ID` answers it when
    it is the only one, and the attached client sees who answered."""
    import json
    import re

    from test_ctl_fast import _same

    sid = _create(opd, "operator_handlers:tool_user")
    with opd.client() as c:
        c.send_input(sid, "rm -rf build")
        [waiting] = wait_for(lambda: c.status(sid).waiting, 10, "the request")
    rid = waiting.request_id
    sock = ["--socket", str(opd.socket)]
    when = r"\d\d:\d\d:\d\d \(\d+s\)|\"since\": [\d.e+]+|\"(rss|disk)_bytes\": (\d+|null)|\d+(\.\d)?(B|KiB|MiB|GiB)"
    ls = _same([*sock, "ls"], mask=when)
    assert re.search(rf"^{sid}\s+running \(waiting\)\s", ls, re.M), ls
    assert f"{sid}: waiting on a person: bash since " in ls
    assert f"request {rid} (sessionctl approve|deny {sid})" in ls
    status = _same([*sock, "status", sid], mask=when)
    assert "state:     running (waiting)" in status and f"waiting:   bash since " in status, status
    for argv in (["--json", "ls"], ["--json", "status", sid]):
        got = json.loads(_same([*sock, *argv], mask=when))
        info = got["sessions"][0] if "sessions" in got else got
        assert info["state"] == "running"  # scripts' field unchanged
        assert [(w["request_id"], w["tool"], w["turn"]) for w in info["waiting"]] == [(rid, "bash", 1)]
    top = opd.ctl("top", "--once", "--sample-secs", "0.05")
    assert "1 waiting on a person" in top.stdout and re.search(rf"^{sid}\s+waiting\s", top.stdout, re.M), top.stdout
    # A plain attach (no --from) is shown the request at once.
    attach = _ctl_process(opd, "attach", sid)
    try:
        _read_until(attach.stdout, f"[permission request {rid}: bash {{\"command\": \"rm -rf build\"}}]")
        approve = opd.ctl("approve", sid)
        assert approve.returncode == 0, approve.stderr
        assert f"allowing bash (request {rid})" in approve.stderr
        said = _read_until(attach.stdout, "[turn 1 done]")
    finally:
        attach.kill()
        attach.wait()
    assert re.search(rf"\[permission request {rid} \(bash\) allowed by uid {os.getuid()} \(sessionctl\) "
                     r"at \d\d:\d\d:\d\d\]", said), said
    nothing = opd.ctl("approve", sid)
    assert nothing.returncode == 1 and "no permission request waiting" in nothing.stderr
    # Two at once: name one (usage), each listed.
    sid2 = _create(opd, "operator_handlers:two_asks")
    with opd.client() as c:
        c.send_input(sid2, "go")
        waiting = wait_for(lambda: len(c.status(sid2).waiting) == 2 and c.status(sid2).waiting, 10, "two requests")
    several = opd.ctl("deny", sid2)
    assert several.returncode == 2, several.stderr
    assert "2 permission requests waiting" in several.stderr
    for w in waiting:
        assert f"{w.request_id}  {w.tool}" in several.stderr
        assert opd.ctl("deny", sid2, w.request_id).returncode == 0
    with opd.client() as c:
        wait_for(lambda: c.status(sid2).state == "idle", 10, "the turn's end")
        assert c.history(sid2).turns[0].reply == "[False, False]"
