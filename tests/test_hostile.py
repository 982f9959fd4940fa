"""Hostile clients against a real daemon: huge length prefixes held open,
slowloris handshakes, connection floods, path traversal through session ids,
`--set` keys and handler names.  test_bad_input.py covers the single bad
frame; here the question is whether one client can starve, exhaust or
escape the daemon while others are being served."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import FAST_CONFIG
from harness import Daemon, raw_connect, wait_for
from ipc import messages as m
from ipc.framing import encode_frame
from test_bad_input import assert_closed, hello, read_frame

pytestmark = pytest.mark.process

HANDSHAKE_TIMEOUT_SECS = 10.0  # supervisor/api/server.py _HANDSHAKE_TIMEOUT_SECS


def num_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def request(s: socket.socket, msg: Any) -> m.Reply:
    """Send one request and read frames until the reply carrying its id."""
    s.sendall(encode_frame(msg))
    while True:
        reply = read_frame(s)
        if getattr(reply, "id", None) == msg.id and not isinstance(reply, m.EVENT_TYPES):
            return reply


def ping_latency(s: socket.socket, rid: int) -> float:
    t0 = time.monotonic()
    reply = request(s, m.Ping(id=rid))
    assert isinstance(reply, m.Pong) and reply.id == rid
    return time.monotonic() - t0


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ---------------------------------------------------------------- huge prefixes


def test_4gib_prefix_held_open_is_refused_and_closed_while_others_are_served(daemon: Daemon) -> None:
    # One before the handshake, one after; both keep their end open and
    # never send the 4 GiB they announced.
    before_hello = raw_connect(daemon.socket)
    after_hello = raw_connect(daemon.socket)
    normal = raw_connect(daemon.socket)
    try:
        hello(after_hello)
        hello(normal)
        before_hello.sendall(struct.pack(">I", 0xFFFFFFFF))
        after_hello.sendall(struct.pack(">I", 0xFFFFFFFF) + b"\x00" * 1000)
        for s in (before_hello, after_hello):
            err = read_frame(s)
            assert isinstance(err, m.Error) and err.code == "bad_request"
            assert "exceeds the limit" in err.message
            assert_closed(s)
        for i in range(20):
            assert ping_latency(normal, i + 1) < 1.0
        with daemon.client() as c:
            assert c.ping().pid == daemon.pid
            # The daemon dropped both: only `normal` and this client remain.
            wait_for(lambda: c.stats().clients == 2, 5, "the refused clients to be forgotten")
            assert c.stats().rss_bytes < 200 * 1024 * 1024
    finally:
        for s in (before_hello, after_hello, normal):
            s.close()


# ---------------------------------------------------------------- slowloris


def _dribble(s: socket.socket, data: bytes, interval: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            s.sendall(data[i : i + 1])
        except OSError:
            return  # the daemon hung up on us
        stop.wait(interval)


def test_slowloris_hello_does_not_stall_others_and_a_never_finished_one_is_cut_off(daemon: Daemon) -> None:
    hello_frame = encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION))
    # 26 bytes at 0.2 s: done in ~5 s, inside the handshake timeout.
    assert len(hello_frame) * 0.2 < HANDSHAKE_TIMEOUT_SECS - 2
    # A frame that announces 4 KiB and never gets there.
    endless = struct.pack(">I", 4096) + b"\x00" * 4096
    stop = threading.Event()
    slow_ok = raw_connect(daemon.socket)
    slow_never = raw_connect(daemon.socket)
    t_never_start = time.monotonic()
    threads = [
        threading.Thread(target=_dribble, args=(slow_ok, hello_frame, 0.2, stop), daemon=True),
        threading.Thread(target=_dribble, args=(slow_never, endless, 0.2, stop), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        latencies: list[float] = []
        with raw_connect(daemon.socket) as normal:
            hello(normal)
            rid = 0
            while threads[0].is_alive():
                rid += 1
                latencies.append(ping_latency(normal, rid))
                time.sleep(0.02)
        # Answered all along: no ping waited for a dribbling client (a
        # stall would last as long as the dribble, ~5 s).
        dribbled = time.monotonic() - t_never_start
        assert len(latencies) >= 20, latencies
        assert max(latencies) < dribbled / 4, f"pings stalled while a client dribbled: {max(latencies):.3f}s"
        # The slow but complete Hello is honoured.
        slow_ok.settimeout(5)
        welcome = read_frame(slow_ok)
        assert isinstance(welcome, m.Welcome)
        slow_ok.sendall(encode_frame(m.Ping(id=1)))
        assert isinstance(read_frame(slow_ok), m.Pong)
        # The never-finished one is told and dropped once the timeout passes.
        slow_never.settimeout(HANDSHAKE_TIMEOUT_SECS + 5)
        err = read_frame(slow_never)
        waited = time.monotonic() - t_never_start
        assert isinstance(err, m.Error) and err.code == "bad_request" and "no hello" in err.message
        assert HANDSHAKE_TIMEOUT_SECS - 0.5 <= waited <= HANDSHAKE_TIMEOUT_SECS + 4, waited
        assert_closed(slow_never)
        with daemon.client() as c:
            assert c.ping().pid == daemon.pid
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        slow_ok.close()
        slow_never.close()


# ---------------------------------------------------------------- connection floods


def test_a_thousand_abandoned_connections_cost_nothing_afterwards(daemon: Daemon) -> None:
    n = 1000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 1000), hard))
    with daemon.client() as c:
        c.ping()
        wait_for(lambda: c.stats().clients == 1, 5, "a quiet daemon")
        baseline = num_fds(daemon.pid)
        conns: list[socket.socket] = []
        try:
            for i in range(n):
                s = raw_connect(daemon.socket)
                conns.append(s)
                if i % 2:
                    s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client=f"idle{i}")))
                if i % 100 == 99:
                    # Served in the middle of the flood, old and new clients alike.
                    assert c.ping().pid == daemon.pid
                if i == n // 2:
                    with daemon.client() as mid:
                        assert mid.ping().pid == daemon.pid
            for i, s in enumerate(conns):
                if i % 2:
                    assert isinstance(read_frame(s), m.Welcome)
            wait_for(lambda: c.stats().clients == n + 1, 10, f"all {n} connections to be accepted")
            assert num_fds(daemon.pid) >= baseline + n
            t0 = time.monotonic()
            c.ping()
            assert time.monotonic() - t0 < 1.0
        finally:
            for s in conns:
                s.close()
        wait_for(lambda: c.stats().clients == 1, 15, "the daemon to forget the abandoned clients")
        wait_for(lambda: num_fds(daemon.pid) <= baseline + 3, 15,
                 f"the daemon's fd count to return to its baseline of {baseline}")
        with daemon.client() as fresh:
            sid = fresh.create(handler="echo").id
            assert fresh.send_text(sid, "still here") == "1: still here"


# ---------------------------------------------------------------- path traversal


BAD_SESSION_IDS = ["../x", "../../escape", "a/b", "/tmp/abs", ".", "..", "", "a" * 65, "a\x00b",
                   "-dash", ".hidden", "a\nb", "x/../../y"]


def test_session_ids_that_could_leave_the_sessions_directory_are_refused(daemon: Daemon) -> None:
    root = daemon.root
    before = tree(root)
    with raw_connect(daemon.socket) as s:
        hello(s)
        for i, bad in enumerate(BAD_SESSION_IDS, start=1):
            reply = request(s, m.Create(id=i, session=bad, handler="echo"))
            assert isinstance(reply, m.Error), (bad, reply)
            assert reply.code == "bad_request" and "invalid session id" in reply.message, (bad, reply)
        # Lookups by such ids find nothing and touch nothing.
        for i, bad in enumerate(BAD_SESSION_IDS, start=100):
            for req in (m.Status(id=i, session=bad), m.Remove(id=i, session=bad),
                        m.Send(id=i, session=bad, text="x"), m.Attach(id=i, session=bad)):
                reply = request(s, req)
                assert isinstance(reply, m.Error) and reply.code == "not_found", (bad, reply)
        listed = request(s, m.List(id=999))
        assert isinstance(listed, m.SessionList) and listed.sessions == []
    after = tree(root)
    assert after - before <= {"sessiond.log"}, sorted(after - before)
    # Right at the edge: 64 characters and dots inside are fine, and stay inside.
    with daemon.client() as c:
        for good in ("a" * 64, "a..b"):
            assert c.create(good, handler="echo").id == good
            assert (daemon.state_dir / "sessions" / good).is_dir()
    new = tree(root) - before
    outside = [p for p in new if not p.startswith(("state/sessions/", "state/workspaces/"))
               and p not in ("sessiond.log", "state/workspaces")]
    assert outside == [], outside


def test_set_keys_cannot_reach_outside_the_session_settings(daemon: Daemon) -> None:
    before = tree(daemon.root)
    attempts: list[dict[str, Any]] = [
        {"daemon.state_dir": "/tmp/elsewhere"},
        {"daemon.socket": "/tmp/evil.sock"},
        {"daemon.allowed_uids": [12345]},
        {"daemon": {"state_dir": "/tmp/elsewhere"}},
        {"agent..limits": 1},
        {".agent": 1},
        {"agent.": 1},
        {"agent.limits.__class__": 1},
        {"agent.limits.max_memory_mb.x": 1},
        # A whole section must not bypass the ceiling the dotted key is held to.
        {"agent": {"limits": {"max_memory_mb": 10**9}}},
        {"agent.limits": {"max_memory_mb": 10**9}},
    ]
    with raw_connect(daemon.socket) as s:
        hello(s)
        for i, settings in enumerate(attempts, start=1):
            reply = request(s, m.Create(id=i, handler="echo", settings=settings))
            assert isinstance(reply, m.Error), (settings, reply)
            assert reply.code == "bad_request", (settings, reply)
        listed = request(s, m.List(id=999))
        assert isinstance(listed, m.SessionList) and listed.sessions == []
    assert tree(daemon.root) - before <= {"sessiond.log"}
    assert not Path("/tmp/elsewhere").exists()
    r = daemon.ctl("create", "--set", "daemon.state_dir=/tmp/elsewhere")
    assert r.returncode == 2 and "daemon.state_dir" in r.stderr
    with daemon.client() as c:
        assert c.ping().pid == daemon.pid


@pytest.mark.parametrize("handler", ["../x:y", "a b:c", "os.path/../x:y", ":x", "x:", "x:y:z", "echo\x00"])
def test_junk_handler_names_are_refused(daemon: Daemon, handler: str) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        reply = request(s, m.Create(id=1, handler=handler))
        assert isinstance(reply, m.Error) and reply.code == "bad_request", reply
        assert "invalid handler" in reply.message
    with daemon.client() as c:
        assert c.list() == []


@pytest.mark.parametrize("handler", ["os:system", "builtins:exit", "json:loads", "antigravity:x",
                                     "import_marker:factory"])
def test_handlers_the_operator_did_not_allow_are_never_imported(
    make_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    # Audit (issue 9): `--handler json:loads` was called and `antigravity`
    # imported for any user.  Now only [agent] allowed_handlers are.
    marker = tmp_path / "imported"
    monkeypatch.setenv("SESSIOND_IMPORT_MARKER", str(marker))  # the daemon's, and so its workers'
    d = make_daemon()
    r = d.ctl("create", "--id", "victim", "--handler", handler)
    assert r.returncode == 2, r
    assert f"handler {handler!r} is not allowed" in r.stderr and "allowed_handlers" in r.stderr, r.stderr
    assert not marker.exists()
    with d.client() as c:
        assert c.list() == []
        assert c.stats().live_workers == 0


# (An allowed module that cannot be imported at all now stops the daemon's
# start, naming it: the zygote preloads it; tests/test_preload.py.)
@pytest.mark.parametrize("handler", ["os:sep", "builtins:exit", "import_marker:factory"])
def test_allowed_handlers_that_cannot_load_fail_cleanly_at_boot(
    make_daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handler: str
) -> None:
    # What the operator allowed reaches the worker, which imports it: what
    # matters is that the create fails, leaves no session and no process
    # behind, and the daemon carries on.
    marker = tmp_path / "imported"
    monkeypatch.setenv("SESSIOND_IMPORT_MARKER", str(marker))
    module = handler.partition(":")[0]
    d = make_daemon(FAST_CONFIG + f'[agent]\nallowed_handlers = ["echo", "{module}:*"]\n')
    r = d.ctl("create", "--id", "victim", "--handler", handler)
    assert r.returncode == 1, r
    assert "could not start" in r.stderr, r.stderr
    assert marker.exists() == (module == "import_marker")  # the marker works
    with d.client() as c:
        assert c.list() == []
        assert not (d.state_dir / "sessions" / "victim").exists()
        wait_for(lambda: c.stats().live_workers == 0, 5, "the failed worker to be gone")
        sid = c.create("after", handler="echo").id
        assert c.send_text(sid, "ok") == "1: ok"
    zygotes = psutil.Process(d.pid).children()
    assert len(zygotes) == 1
    # Only the echo worker and the spare workers ([daemon] spare_workers,
    # 2 by default) are left under the zygote.
    wait_for(lambda: len(zygotes[0].children()) == 1 + 2, 5, "the zygote's children to settle")


# ---------------------------------------------------------------- nesting


def test_deeply_nested_frame_gets_bad_request_and_the_connection_survives(daemon: Daemon) -> None:
    nested = b"\x91" * 5000 + b"\x01"  # [[[[...1...]]]]
    body = b"\x83\xa4type\xa4ping\xa2id\x01\xa4junk" + nested
    with raw_connect(daemon.socket) as s:
        hello(s)
        s.sendall(struct.pack(">I", len(body)) + body)
        try:
            err = read_frame(s)
        finally:
            # Whatever happens to this connection, the daemon must live on.
            with daemon.client() as c:
                assert c.ping().pid == daemon.pid
        assert isinstance(err, m.Error) and err.code == "bad_request"
        s.sendall(encode_frame(m.Ping(id=2)))
        assert isinstance(read_frame(s), m.Pong)


def test_invalid_utf8_gets_bad_request_and_the_connection_survives(daemon: Daemon) -> None:
    frame = encode_frame(m.Send(id=1, session="ghost", text="x")).replace(b"\xa1x", b"\xa1\xff")
    with raw_connect(daemon.socket) as s:
        hello(s)
        s.sendall(frame)
        try:
            err = read_frame(s)
        finally:
            with daemon.client() as c:
                assert c.ping().pid == daemon.pid
        assert isinstance(err, m.Error) and err.code == "bad_request" and err.id == 0
        s.sendall(encode_frame(m.Ping(id=2)))
        assert isinstance(read_frame(s), m.Pong)


def test_4gib_prefix_split_across_reads_is_answered_before_the_close(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        s.sendall(b"\xff\xff")
        # Let the daemon read the first half on its own.
        with daemon.client() as c:
            assert c.ping().pid == daemon.pid
        s.sendall(b"\xff\xff")
        try:
            err = read_frame(s)
        finally:
            with daemon.client() as c:
                assert c.ping().pid == daemon.pid
        assert isinstance(err, m.Error) and "exceeds the limit" in err.message
        assert_closed(s)
