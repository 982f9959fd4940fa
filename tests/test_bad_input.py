"""Hostile and broken clients: the daemon answers, survives, loses nothing."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from harness import Daemon, env_for_children, raw_connect, wait_for
from ipc import messages as m
from ipc.framing import encode_frame

pytestmark = pytest.mark.process

_reply = msgspec.msgpack.Decoder(m.Reply)


def read_frame(s: socket.socket) -> m.Reply:
    header = _recv_exact(s, 4)
    (length,) = struct.unpack(">I", header)
    return _reply.decode(_recv_exact(s, length))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def hello(s: socket.socket) -> None:
    s.sendall(encode_frame(m.Hello(protocol=m.PROTOCOL_VERSION, client="test")))
    assert isinstance(read_frame(s), m.Welcome)


def assert_closed(s: socket.socket) -> None:
    s.settimeout(5)
    assert s.recv(1) == b""


def test_malformed_frame_gets_error_and_connection_survives(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        garbage = b"\xc1\xff\x00not msgpack"
        s.sendall(struct.pack(">I", len(garbage)) + garbage)
        err = read_frame(s)
        assert isinstance(err, m.Error) and err.code == "bad_request"
        s.sendall(encode_frame(m.Ping(id=7)))
        pong = read_frame(s)
        assert isinstance(pong, m.Pong) and pong.id == 7


def test_unknown_tag_and_wrong_field_types(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        s.sendall(encode_frame({"type": "launch_missiles", "id": 1}))
        err = read_frame(s)
        assert isinstance(err, m.Error) and err.code == "bad_request" and "launch_missiles" in err.message
        s.sendall(encode_frame({"type": "send", "id": "one", "session": 5, "text": None}))
        err = read_frame(s)
        assert isinstance(err, m.Error) and err.code == "bad_request"
        s.sendall(encode_frame(m.Ping(id=2)))
        assert isinstance(read_frame(s), m.Pong)


def test_oversized_length_prefix_is_refused_without_allocating(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        s.sendall(struct.pack(">I", 0xFFFFFFFF))  # 4 GiB announced, never sent
        err = read_frame(s)
        assert isinstance(err, m.Error) and "exceeds the limit" in err.message
        assert_closed(s)
    with daemon.client() as c:
        assert c.ping().pid == daemon.pid
        stats = c.stats()
        assert stats.rss_bytes < 200 * 1024 * 1024


def test_wrong_protocol_version(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        s.sendall(encode_frame(m.Hello(protocol=999)))
        err = read_frame(s)
        assert isinstance(err, m.Error) and err.code == "protocol_mismatch"
        assert_closed(s)


def test_request_before_hello_is_refused(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        s.sendall(encode_frame(m.List(id=1)))
        err = read_frame(s)
        assert isinstance(err, m.Error) and "hello" in err.message
        assert_closed(s)


def test_unknown_session_requests(daemon: Daemon) -> None:
    with raw_connect(daemon.socket) as s:
        hello(s)
        for i, req in enumerate([
            m.Send(id=1, session="ghost", text="x"), m.Status(id=2, session="ghost"),
            m.Stop(id=3, session="ghost"), m.Remove(id=4, session="ghost"),
            m.Attach(id=5, session="ghost"), m.Interrupt(id=6, session="ghost"),
        ], start=1):
            s.sendall(encode_frame(req))
            err = read_frame(s)
            assert isinstance(err, m.Error) and err.code == "not_found" and err.id == i


def test_client_vanishing_mid_stream_does_not_hurt_the_session(daemon: Daemon) -> None:
    with daemon.client() as c:
        sid = c.create(handler="fixture_handlers:slow").id
    # A raw client starts a long turn and disappears mid-stream.
    s = raw_connect(daemon.socket)
    hello(s)
    s.sendall(encode_frame(m.Send(id=1, session=sid, text="25")))
    wait_for(lambda: isinstance(read_frame(s), m.TextDelta), 10, "a delta")
    s.close()
    with daemon.client() as c:
        wait_for(lambda: c.status(sid).state == "idle", 10, "the turn to finish anyway")
        assert c.status(sid).turns == 1
        assert c.send_text(sid, "2") == "tick 0\ntick 1\n"


def test_slow_reader_is_cut_off_not_the_session(make_daemon) -> None:
    # The default stream_buffer_size (1024 frames): a reader that keeps up
    # is never near it, even though one pass of the daemon's loop may
    # forward a burst of a hundred frames at once.
    d = make_daemon()
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:big_reply").id
    lazy = raw_connect(d.socket)
    lazy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hello(lazy)
    lazy.sendall(encode_frame(m.Attach(id=1, session=sid)))
    with d.client() as c:
        # 8 MiB (2,048 frames, 4 MB/s) through a reader that never reads.
        assert c.send_text(sid, str(8 * 1024 * 1024)) == "big"
        assert c.status(sid).state == "idle"
        wait_for(lambda: c.stats().clients == 1, 10, "the lazy client to be disconnected")
    assert "fell" in d.log and "behind" in d.log
    lazy.close()


def test_invalid_config_names_key_and_file(tmp_path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[agent.limits]\nmax_memroy_mb = 5\n")
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "config", "check", str(cfg)],
                       capture_output=True, text=True, env=env_for_children())
    assert r.returncode == 2
    assert "agent.limits.max_memroy_mb" in r.stderr and str(cfg) in r.stderr
    cfg.write_text("[agent]\nmax_turns = 0\n")
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg),
                        "--state-dir", str(tmp_path / "st"), "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert r.returncode == 2 and "agent.max_turns" in r.stderr and str(cfg) in r.stderr
    assert "Traceback" not in r.stderr


def test_unwritable_state_dir(tmp_path) -> None:
    if os.geteuid() == 0:
        # Root ignores permission bits; /proc/sys refuses new entries to anyone.
        state = Path("/proc/sys/sessiond-state")
    else:
        state = tmp_path / "ro"
        state.mkdir(mode=0o500)
    _assert_clear_state_error(tmp_path, state)


def test_state_dir_that_is_a_file(tmp_path) -> None:
    state = tmp_path / "file"
    state.write_text("not a directory")
    _assert_clear_state_error(tmp_path, state)


def _assert_clear_state_error(tmp_path, state) -> None:
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(state),
                        "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert r.returncode == 1
    assert "state directory" in r.stderr and str(state) in r.stderr
    assert "Traceback" not in r.stderr


def test_second_daemon_on_the_same_socket_refuses(daemon: Daemon, tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--socket", str(daemon.socket),
                        "--state-dir", str(tmp_path / "other")],
                       capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert r.returncode == 1 and "already listening" in r.stderr
    with daemon.client() as c:
        assert c.ping().pid == daemon.pid


def test_full_disk_refuses_input_and_loses_nothing(make_daemon) -> None:
    import resource

    d = make_daemon(start=False)
    # RLIMIT_FSIZE makes writes past 256 KiB fail with EFBIG, as a full disk would.
    d.preexec = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    d.start()
    with d.client() as c:
        sid = c.create().id
        assert c.send_text(sid, "small") == "1: small"
        from supervisor.ctl.client import RequestError

        big = "y" * (300 * 1024)
        with pytest.raises(RequestError) as err:
            c.send_text(sid, big)
        # A code a script can act on, and the cause in words, not "short write".
        assert err.value.code == "no_space", err.value.message
        assert "not accepted" in err.value.message and "No space left on device" in err.value.message
        # A client that did not say it knows `no_space` (protocol 1 as it
        # shipped) would fail to decode it: it gets `internal`, same words.
        with raw_connect(d.socket) as s:
            hello(s)
            s.sendall(encode_frame(m.Send(id=9, session=sid, text=big)))
            reply = read_frame(s)
            assert isinstance(reply, m.Error) and reply.code == "internal"
            assert "No space left on device" in reply.message
        # Nothing half-written: the session carries on from its last good turn.
        assert c.status(sid).turns == 1
        assert c.send_text(sid, "after") == "2: after"
    d.kill()
    d.start()
    with d.client() as c:
        assert c.status(sid).turns == 2
        assert c.send_text(sid, "restored") == "3: restored"


def test_accepted_precedes_the_end_of_its_turn_on_the_wire(daemon: Daemon) -> None:
    # A fast turn commits its input and its output with one fsync; the
    # acknowledgement must still reach the client before the turn's end.
    with daemon.client() as c:
        sid = c.create().id
    with raw_connect(daemon.socket) as s:
        hello(s)
        for i in range(20):
            s.sendall(encode_frame(m.Send(id=i + 1, session=sid, text=f"t{i}")))
            kinds = []
            while not kinds or not isinstance(kinds[-1], (m.TurnDone, m.TurnFailed)):
                kinds.append(read_frame(s))
            accepted = [k for k in kinds if isinstance(k, m.Accepted)]
            assert len(accepted) == 1 and accepted[0].id == i + 1
            assert kinds.index(accepted[0]) < len(kinds) - 1
            assert kinds[-1].reply == f"{i + 1}: t{i}"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_socket_directory_owned_by_someone_else_is_refused(tmp_path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(tmp_path / "st"),
                        "--socket", str(theirs / "s.sock")],
                       capture_output=True, text=True, env=env_for_children(), timeout=30)
    assert r.returncode == 1 and "belongs to uid 65534" in r.stderr and "Traceback" not in r.stderr
