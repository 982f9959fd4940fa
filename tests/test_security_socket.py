"""Security audit of the control socket (issue 9), each attack reproduced
through the public surface against a real daemon:

* a session's own tools (and tools that escaped with setsid + fork) must
  not drive the daemon, whatever uid they run as;
* who is admitted: root, the daemon's own user, admin_uids, allowed_uids,
  allowed_gids (supplementary groups from the socket, right under EMFILE);
* a per-uid connection quota;
* one client cannot grow the daemon's memory without bound (a backlog
  bounded in bytes, a deadline on a frame that has begun to arrive);
* a client's name cannot forge log lines.

Acting as another user needs root: those tests are skipped otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import psutil
import pytest

from fakellm import FakeLLM, text_stream, tool_call_stream
from harness import Daemon, raw_connect, run_as, wait_for
from test_agent_e2e import agent_config as e2e_agent_config
from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.errors import FrameTimeout, ProtocolError
from ipc.framing import encode_frame
from supervisor.api import peer
from supervisor.config import Config, DaemonSettings
from supervisor.core.admission import Admission, Identities
from supervisor.core.manager import SessionManager
from supervisor.api.server import ControlServer
from test_bad_input import assert_closed, hello, read_frame

NOBODY = 65534
EXTRA_GID = 4242  # a supplementary group nobody is given in the tests below
MiB = 1024 * 1024
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
_reply = msgspec.msgpack.Decoder(m.Reply)
_request = msgspec.msgpack.Decoder(m.Request)


# ---------------------------------------------------------------- helpers



def outcome(s: socket.socket) -> str:
    """What the daemon answers a Hello on `s`: "welcome", an error code,
    "eof" (closed without a word) or "timeout"."""
    try:
        with contextlib.suppress(OSError):
            s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client="probe")))
        reply = read_frame(s)
    except TimeoutError:
        return "timeout"
    except (ConnectionError, OSError):
        return "eof"
    if isinstance(reply, m.Welcome):
        return "welcome"
    assert isinstance(reply, m.Error), reply
    return f"{reply.code}: {reply.message}"


def connect(path: Path, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(str(path))
    return s


def open_up(d: Daemon) -> None:
    os.chmod(d.sockdir, 0o755)


def peak_rss(pid: int) -> int:
    """VmHWM: the most the process ever had resident, so a burst between
    two samples is not missed."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


# ---------------------------------------------------------------- 1. sessions


def agent_config(llm: FakeLLM, extra: str = "") -> str:
    return e2e_agent_config(llm, extra, key_env=None)


@pytest.mark.process
def test_a_sessions_tools_cannot_drive_the_daemon_even_after_escaping(make_daemon, llm: FakeLLM) -> None:
    """The daemon's own check, the layer under the sandbox: with the sandbox
    off the socket is in a tool's reach, and the peer is still refused.
    (With the sandbox on, the socket is not even in view: test_sandbox.py.)"""
    d = make_daemon(agent_config(llm, '[sandbox]\nmode = "off"'))
    with d.client() as c:
        victim = c.create(session="victim", handler="echo").id
        assert c.send_text(victim, "hello") == "1: hello"
        agent = c.create(session="agent").id
    workspace = d.workspace(agent)
    ctl = f"timeout 10 {sys.executable} -m supervisor.ctl --socket {d.socket}"
    # What a prompt-injected agent would run: list everyone's sessions,
    # read another user's, delete it; and the same from a process that
    # left the session's process group and its parent (setsid + fork), so
    # that it re-parents to the zygote once its parent is gone.
    command = (
        f"{ctl} ls --json; echo ls-rc=$?; "
        f"{ctl} attach {victim} --from 0; echo attach-rc=$?; "
        f"{ctl} rm {victim}; echo rm-rc=$?; "
        f"(setsid sh -c '{ctl} ls --json > {workspace}/escaped.txt 2>&1; "
        f"echo escaped-rc=$? >> {workspace}/escaped.txt' &)"
    )
    llm.script(tool_call_stream(("c1", "bash", {"command": command})), text_stream("done"))
    with d.client() as c:
        assert c.send_text(agent, "go") == "done"
        out = [msg["content"] for msg in llm.requests[1].json["messages"] if msg["role"] == "tool"][0]
        assert "ls-rc=1" in out and "attach-rc=1" in out and "rm-rc=1" in out, out
        assert out.count("connections from inside a session") == 3, out
        assert "victim" not in out  # no listing, no replay
        escaped = workspace / "escaped.txt"
        wait_for(lambda: "escaped-rc=" in (escaped.read_text() if escaped.exists() else ""),
                 20, "the escaped tool's sessionctl to finish")
        text = escaped.read_text()
        assert "escaped-rc=1" in text and "connections from inside a session" in text, text
        # Nothing was done on their behalf.
        assert c.status(victim).state != "deleted"
        assert {s.id for s in c.list()} == {victim, agent}
    assert d.log.count("it runs inside a session") == 4


def _listener(tmp_path: Path) -> socket.socket:
    path = tmp_path / "s"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    return srv


def _peer_child(path: str, linger: bool) -> subprocess.Popen[bytes]:
    code = (f"import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect({path!r}); "
            + ("sys.stdin.read()" if linger else "pass"))
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


@pytest.mark.process
def test_peer_ancestry_and_a_dead_peers_reused_pid(tmp_path: Path) -> None:
    """supervisor.api.peer without a daemon: our child descends from us and not
    from pid 1's other children; a peer that has exited is refused even
    though its pid now names nobody (or someone else)."""
    srv = _listener(tmp_path)
    path = srv.getsockname()
    live = _peer_child(path, linger=True)
    conn, _ = srv.accept()
    try:
        cred = peer.credentials(conn)
        assert cred.pid == live.pid and cred.uid == os.getuid()
        uids = peer.SessionUids(os.geteuid(), None, None)
        assert peer.in_session(conn, cred, frozenset({os.getpid()}), uids)
        assert not peer.in_session(conn, cred, frozenset({os.getppid() + 10**7}), uids)
        # Gone (and reaped): its pid proves nothing any more.
        live.communicate(b"")
        assert not psutil.pid_exists(live.pid)
        assert peer.in_session(conn, cred, frozenset({10**7}), uids)
    finally:
        conn.close()
        srv.close()


@pytest.mark.process
@root_only
def test_supplementary_groups_come_from_the_socket() -> None:
    # Not under pytest's tmp_path: its parents are private to root.
    where = Path(tempfile.mkdtemp(prefix="sd-groups-"))
    os.chmod(where, 0o755)
    srv = _listener(where)
    srv.settimeout(10)
    os.chmod(srv.getsockname(), 0o666)
    many = tuple(range(5000, 5000 + 300))  # past the first buffer: the ERANGE retry

    def connect_and_wait() -> int:
        s = socket.socket(socket.AF_UNIX)
        s.connect(srv.getsockname())
        s.recv(1)
        return 0

    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups(list(many))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            connect_and_wait()
        finally:
            os._exit(0)
    conn, _ = srv.accept()
    try:
        cred = peer.credentials(conn)
        assert (cred.uid, cred.gid) == (NOBODY, NOBODY)
        assert cred.groups == frozenset(many)
    finally:
        conn.close()
        srv.close()
        os.waitpid(pid, 0)
        shutil.rmtree(where, ignore_errors=True)


# ---------------------------------------------------------------- 2. who is admitted


def _server(own_uid: int, socket_gid: int | None = None, **daemon: Any) -> ControlServer:
    """A ControlServer over a stand-in manager whose admission is the real
    one (supervisor.core.admission), as the daemon builds it."""
    cfg = Config(daemon=DaemonSettings(**daemon))
    admission = Admission(lambda: cfg, Identities(socket_gid=socket_gid))
    admission.own_uid = own_uid
    mgr = SimpleNamespace(config=cfg, admission=admission)
    mgr.is_admin = lambda uid: SessionManager.is_admin(mgr, uid)  # type: ignore[arg-type]
    return ControlServer(mgr)  # type: ignore[arg-type]


@pytest.mark.pure
def test_who_is_admitted() -> None:
    def cred(uid: int, gid: int = 100, groups: tuple[int, ...] = ()) -> peer.PeerCredentials:
        return peer.PeerCredentials(pid=1, uid=uid, gid=gid, groups=frozenset(groups))

    server = _server(1000, socket_gid=88, admin_uids=[2000], allowed_uids=[3000], allowed_gids=[77])
    admitted = [cred(0), cred(1000), cred(2000), cred(3000), cred(4000, gid=77),
                cred(4000, groups=(5, 77)), cred(4000, groups=(88,)), cred(4000, gid=88)]
    refused = [cred(4000), cred(4000, groups=(5, 6)), cred(1001)]
    assert all(server.admits(c) for c in admitted)
    assert not any(server.admits(c) for c in refused)
    # The daemon's own user counts toward the quota like anyone else; admins do not.
    is_admin = server.manager.is_admin
    assert is_admin(0) and is_admin(2000)
    assert not is_admin(1000) and not is_admin(3000)
    # The socket's group does not open the door when it is root's.
    root_group = _server(1000, socket_gid=0)
    assert not root_group.admits(cred(4000, gid=0))


def hello_and_list(path: str) -> Callable[[], list[str]]:
    def run() -> list[str]:
        with connect(Path(path)) as s:
            first = outcome(s)
            if first != "welcome":
                return [first]
            s.sendall(encode_frame(m.List(id=1)))
            reply = read_frame(s)
            return [first, type(reply).__name__]
    return run


@pytest.mark.process
@root_only
def test_admin_uids_are_admitted(make_daemon) -> None:
    d = make_daemon(f'[daemon]\nsocket_mode = "0666"\nadmin_uids = [{NOBODY}]\n')
    open_up(d)
    assert run_as(NOBODY, hello_and_list(str(d.socket))) == ["welcome", "SessionList"]


@pytest.mark.process
@root_only
def test_a_supplementary_group_in_allowed_gids_is_admitted(make_daemon) -> None:
    d = make_daemon(f'[daemon]\nsocket_mode = "0666"\nallowed_gids = [{EXTRA_GID}]\n')
    open_up(d)
    assert run_as(NOBODY, hello_and_list(str(d.socket)), groups=(EXTRA_GID,)) == ["welcome", "SessionList"]
    assert run_as(NOBODY, hello_and_list(str(d.socket)))[0].startswith("permission_denied")


# ---------------------------------------------------------------- 3. EMFILE


def _limit_fds(n: int) -> Callable[[], None]:
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return preexec


@pytest.mark.process
@root_only
def test_out_of_file_descriptors_nobody_is_wrongly_denied_and_service_resumes(make_daemon) -> None:
    d = make_daemon(
        f'[daemon]\nsocket_mode = "0666"\nallowed_gids = [{EXTRA_GID}]\n'
        "max_connections_per_uid = 100000\nspare_workers = 0\n", start=False,
    )
    d.preexec = _limit_fds(64)
    d.start()
    open_up(d)
    path = str(d.socket)

    def flood() -> dict[str, Any]:
        held: list[socket.socket] = []
        seen: list[str] = []
        try:
            # Until the daemon can take no more, then a few past that: each
            # is answered (or dropped) before the next, so the one that takes
            # the daemon's last descriptor is among them.
            refused_in_a_row = 0
            while refused_in_a_row < 5 and len(held) < 500:
                s = connect(Path(path), timeout=3.0)
                held.append(s)
                seen.append(outcome(s))
                refused_in_a_row = 0 if seen[-1] == "welcome" else refused_in_a_row + 1
        finally:
            for s in held:
                s.close()
        # Served normally again once the flood is gone (the daemon notices
        # the closed connections as it gets to them).
        deadline = time.monotonic() + 15
        after: list[str] = []
        while time.monotonic() < deadline:
            after = hello_and_list(path)()
            if after == ["welcome", "SessionList"]:
                break
            time.sleep(0.05)
        return {"seen": seen, "after": after}

    result = run_as(NOBODY, flood, groups=(EXTRA_GID,))
    seen, after = result["seen"], result["after"]
    assert "welcome" in seen and seen[-1] != "welcome", seen  # it did run out
    assert not [o for o in seen if o.startswith("permission_denied")], seen
    assert all(o in ("welcome", "eof", "timeout") or o.startswith("capacity") for o in seen), seen
    assert after == ["welcome", "SessionList"]
    with d.client() as c:
        sid = c.create(handler="echo").id
        assert c.send_text(sid, "still here") == "1: still here"


# ---------------------------------------------------------------- 4. quota


@pytest.mark.process
@root_only
def test_connections_per_uid_are_capped_and_root_is_exempt(make_daemon) -> None:
    d = make_daemon(f'[daemon]\nsocket_mode = "0666"\nallowed_uids = [{NOBODY}]\nmax_connections_per_uid = 3\n')
    open_up(d)
    path = Path(d.socket)

    def over_quota() -> dict[str, Any]:
        held = [connect(path) for _ in range(3)]
        first = [outcome(s) for s in held]
        extra = connect(path)
        refused = outcome(extra)
        try:
            extra.settimeout(5)
            closed = extra.recv(1) == b""
        except OSError:
            closed = True
        held.pop().close()
        # A slot comes back once the daemon has seen the close.
        deadline = time.monotonic() + 10
        again = ""
        while time.monotonic() < deadline:
            with connect(path) as s:
                again = outcome(s)
            if again == "welcome":
                break
            time.sleep(0.05)
        for s in held:
            s.close()
        return {"first": first, "refused": refused, "closed": closed, "again": again}

    result = run_as(NOBODY, over_quota)
    assert result["first"] == ["welcome"] * 3
    assert result["refused"].startswith("capacity") and "max_connections_per_uid" in result["refused"]
    assert result["closed"]
    assert result["again"] == "welcome"
    # Root is exempt.
    conns = [raw_connect(d.socket) for _ in range(6)]
    try:
        for s in conns:
            hello(s)
    finally:
        for s in conns:
            s.close()


# ---------------------------------------------------------------- 5. memory


@pytest.mark.process
def test_an_attach_flood_on_a_connection_that_never_reads_is_cut_off_with_bounded_memory(make_daemon) -> None:
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:big_reply").id
        assert c.send_text(sid, str(1 * MiB)) == "big"  # ~1 MiB of retained events
        c.ping()
        wait_for(lambda: c.stats().clients == 1, 5, "a quiet daemon")
    reset_peak_rss(d.pid)
    before = peak_rss(d.pid)
    lazy = raw_connect(d.socket)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        hello(lazy)
        # The audit's repro: 200 replays of everything retained, asked in
        # one write, on a connection that never reads a byte of them.
        lazy.sendall(b"".join(encode_frame(m.Attach(id=i + 1, session=sid, from_seq=0)) for i in range(200)))
        with d.client() as c:
            wait_for(lambda: c.stats().clients == 1, 10, "the flooding client to be cut off")
            assert c.ping().pid == d.pid
            assert c.send_text(sid, "4096") == "big"
        grown = peak_rss(d.pid) - before
        assert grown < 40 * MiB, f"the daemon grew {grown / MiB:.0f} MiB"
        assert "client_buffer_bytes" in d.log
    finally:
        lazy.close()


@pytest.mark.process
def test_half_sent_frames_are_cut_off_after_frame_timeout_secs(make_daemon) -> None:
    d = make_daemon("[daemon]\nframe_timeout_secs = 2.0\n")
    with d.client() as c:
        c.ping()
    base = rss(d.pid)
    conns = [raw_connect(d.socket) for _ in range(20)]
    try:
        t0 = time.monotonic()
        for s in conns:
            hello(s)
            # The audit's repro: a 16 MiB frame, half of it sent, then silence.
            s.sendall(struct.pack(">I", 16 * MiB - 64) + b"\x00" * (8 * MiB))
        held = rss(d.pid) - base
        with d.client() as c:  # served meanwhile
            assert c.ping().pid == d.pid
        for s in conns:
            s.settimeout(15)
            err = read_frame(s)
            assert isinstance(err, m.Error) and err.code == "bad_request", err
            assert "incomplete" in err.message and "frame_timeout_secs" in err.message, err.message
            assert_closed(s)
        waited = time.monotonic() - t0
        assert waited >= 2.0, waited
        with d.client() as c:
            wait_for(lambda: c.stats().clients == 1, 10, "the cut-off clients to be forgotten")
        assert held > 100 * MiB, f"the frames were not held in the first place ({held / MiB:.0f} MiB)"
        wait_for(lambda: rss(d.pid) - base < 48 * MiB, 10,
                 "the daemon to let go of the unfinished frames")
    finally:
        for s in conns:
            s.close()


@pytest.mark.process
def test_a_frame_completed_in_slow_pieces_within_the_timeout_is_served(make_daemon) -> None:
    # The deadline is per frame, not per connection: frames that each take
    # most of it, one after another, all go through.
    d = make_daemon("[daemon]\nframe_timeout_secs = 1.0\n")
    with raw_connect(d.socket) as s:
        hello(s)
        for i in range(4):
            frame = encode_frame(m.Ping(id=i + 1))
            s.sendall(frame[:3])
            # Hold the frame unfinished for longer than half the timeout:
            # the daemon must neither answer nor hang up meanwhile.
            s.settimeout(0.6)
            with pytest.raises(TimeoutError):
                s.recv(1)
            s.settimeout(10)
            s.sendall(frame[3:])
            reply = read_frame(s)
            assert isinstance(reply, m.Pong) and reply.id == i + 1


@pytest.mark.protocol
def test_protocol_backlog_in_bytes_always_takes_one_frame() -> None:
    """FramedProtocol over a socketpair: an empty queue takes a frame of any
    size; past the byte bound the next frame is refused and on_lagged told."""
    async def main() -> None:
        ours, theirs = socket.socketpair()
        lagged: list[int] = []
        _, proto = await asyncio.get_running_loop().connect_accepted_socket(
            lambda: FramedProtocol(_request, max_backlog_bytes=1000, on_lagged=lagged.append), ours)
        try:
            assert proto.send_frame(bytearray(5000))
            assert proto.queued_bytes == 5000
            assert not proto.send_frame(b"x" * 10) and lagged == [0]
        finally:
            proto.abort()
            theirs.close()
    asyncio.run(main())


@pytest.mark.protocol
def test_protocol_frame_timeout_fires_once_per_unfinished_frame() -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair()
        bad: list[ProtocolError] = []
        got: list[Any] = []
        loop = asyncio.get_running_loop()
        _, proto = await loop.connect_accepted_socket(
            lambda: FramedProtocol(_request, frame_timeout=0.3, on_message=got.append,
                                   on_bad_message=bad.append), ours)
        try:
            theirs.setblocking(False)
            frame = encode_frame(m.Ping(id=1))
            theirs.sendall(frame + frame[:2])  # one whole frame, one begun
            deadline = loop.time() + 5
            while not bad and loop.time() < deadline:
                await asyncio.sleep(0.01)  # polling the loop under test, with a deadline
            assert len(got) == 1 and len(bad) == 1 and isinstance(bad[0], FrameTimeout)
            assert bad[0].buffered == 2
            assert proto.close_reason is bad[0]
        finally:
            proto.abort()
            theirs.close()
    asyncio.run(main())


# ---------------------------------------------------------------- 6. logs


@pytest.mark.process
def test_a_client_name_cannot_forge_log_lines(daemon: Daemon) -> None:
    forged = "2026-01-01 00:00:00,000 ERROR sessiond: FORGED admin access granted"
    name = "x\n" + forged + "\r\x1b[2J" + "A" * 200
    with raw_connect(daemon.socket) as s:
        s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client=name)))
        assert isinstance(read_frame(s), m.Welcome)
        s.sendall(struct.pack(">I", 0xFFFFFFFF))  # logged with the client's name
        assert isinstance(read_frame(s), m.Error)
    wait_for(lambda: "sent a frame of" in daemon.log, 5, "the oversized frame to be logged")
    lines = daemon.log.splitlines()
    assert not [line for line in lines if line.startswith(forged[:10]) or "\x1b" in line], lines
    warned = next(line for line in lines if "sent a frame of" in line)
    assert re.search(r"x\\n2026-01-01 .*FORGED", warned), warned
    assert "A" * 64 not in warned  # bounded
