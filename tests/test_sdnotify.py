"""supervisor.ops.sdnotify against real sockets: a fake NOTIFY_SOCKET that checks
the sender's kernel credentials as systemd does, systemd-socket-activate for
the listen-fd handover, and journald's $JOURNAL_STREAM convention."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.ops import sdnotify

REPO = Path(__file__).resolve().parent.parent
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FakeManager:
    """The service manager's end of $NOTIFY_SOCKET: a datagram socket with
    SO_PASSCRED, so each message comes with the pid the kernel vouches for."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def _recv_one(self) -> tuple[str, int]:
        data, ancdata, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        pid = -1
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = _UCRED.unpack(payload[: _UCRED.size])
        return data.decode(), pid

    def recv(self, timeout: float = 5.0) -> tuple[str, int]:
        """The next message and its sender pid, waiting at most ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            return self._recv_one()
        finally:
            self.sock.setblocking(False)

    def drain(self) -> list[str]:
        """Every message already queued, without waiting."""
        self.sock.setblocking(False)
        out: list[str] = []
        while True:
            try:
                out.append(self._recv_one()[0])
            except BlockingIOError:
                return out


def _short_tmpdir() -> str:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    return tempfile.mkdtemp(prefix="sdn-", dir="/tmp")


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeManager]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    tmpdir = None
    if request.param == "path":
        tmpdir = _short_tmpdir()
        path = os.path.join(tmpdir, "notify")
        sock.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
    else:
        name = f"sessiond-test-{os.getpid()}-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        yield FakeManager(sock)
    finally:
        sock.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------
# notify()


@pytest.mark.pure
def test_notify_without_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False
    assert sdnotify.watchdog_ping() is False


@pytest.mark.protocol
def test_each_helper_sends_its_assignment_with_our_credentials(manager: FakeManager) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading() is True
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    text, pid = manager.recv()
    assert pid == os.getpid()
    lines = text.split("\n")
    assert lines[0] == "RELOADING=1"
    key, _, usec = lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after

    expected: list[tuple[Callable[..., bool], tuple[str, ...], str]] = [
        (sdnotify.ready, (), "READY=1"),
        (sdnotify.ready, ("serving",), "READY=1\nSTATUS=serving"),
        (sdnotify.status, ("3 sessions\nidle",), "STATUS=3 sessions idle"),
        (sdnotify.watchdog_ping, (), "WATCHDOG=1"),
        (sdnotify.stopping, (), "STOPPING=1"),
        (sdnotify.notify, ("STATUS=a", "ERRNO=5"), "STATUS=a\nERRNO=5"),
    ]
    for fn, args, wire in expected:
        assert fn(*args) is True, fn
        text, pid = manager.recv()
        assert (text, pid) == (wire, os.getpid())
    assert manager.drain() == []


@pytest.mark.protocol
def test_send_failures_return_false_and_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    tmpdir = _short_tmpdir()
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", os.path.join(tmpdir, "nobody-listens"))
        assert sdnotify.notify("READY=1") is False
        monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")  # not a form we speak
        assert sdnotify.notify("READY=1") is False
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + "x" * 200)  # longer than sun_path
        assert sdnotify.notify("READY=1") is False
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.protocol
@pytest.mark.timeout(15)
def test_full_manager_queue_drops_pings_instead_of_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A service manager that stops reading must not stall the event loop: the
    # kernel queue of a datagram socket holds only net.unix.max_dgram_qlen
    # messages, after which a blocking sender would hang here until timeout.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"sessiond-test-full-{uuid.uuid4().hex}"
    sock.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    try:
        results = [sdnotify.watchdog_ping() for _ in range(2000)]
    finally:
        sock.close()
    assert results[0] is True
    assert False in results


# --------------------------------------------------------------------------
# Watchdog


@pytest.mark.pure
@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "other", None),
        ("1000000", "", 0.5),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
        ("30000000", "nope", None),
    ],
)
def test_watchdog_interval_is_half_the_timeout_and_only_for_us(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for var, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(var, value)
    assert sdnotify.watchdog_interval_secs() == expected


async def _collect(
    manager: FakeManager, want: Callable[[list[tuple[float, str]]], bool], deadline_secs: float = 5.0
) -> list[tuple[float, str]]:
    """Receive (time, message) pairs while the loop runs, until ``want`` holds."""
    got: list[tuple[float, str]] = []
    deadline = time.monotonic() + deadline_secs
    while not want(got):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting; received {got!r}")
        now = time.monotonic()
        got.extend((now, m) for m in manager.drain())
        await asyncio.sleep(0.002)
    return got


def _pings(got: list[tuple[float, str]]) -> list[float]:
    return [t for t, m in got if m == "WATCHDOG=1"]


@pytest.mark.component
@pytest.mark.parametrize("manager", ["abstract"], indirect=True)
def test_watchdog_loop_pings_at_the_interval_and_reports_status_changes(manager: FakeManager) -> None:
    interval = 0.05
    state = {"text": "starting"}

    async def main() -> list[tuple[float, str]]:
        task = asyncio.create_task(sdnotify.watchdog_loop(interval, lambda: state["text"]))
        try:
            got = await _collect(manager, lambda g: len(_pings(g)) >= 4)
            state["text"] = "serving 2 sessions"
            got += await _collect(manager, lambda g: len(_pings(g)) >= 8)
            return got
        finally:
            task.cancel()

    got = asyncio.run(main())
    pings = _pings(got)
    span = pings[-1] - pings[0]
    gaps = len(pings) - 1
    # Receive times are polled every 2 ms; 0.8x/1.6x absorbs that and load.
    assert gaps * interval * 0.8 <= span <= gaps * interval * 1.6, (span, pings)
    statuses = [m for _, m in got if m.startswith("STATUS=")]
    assert statuses == ["STATUS=starting", "STATUS=serving 2 sessions"]


@pytest.mark.component
@pytest.mark.parametrize("manager", ["path"], indirect=True)
def test_watchdog_loop_goes_silent_while_the_event_loop_is_blocked(manager: FakeManager) -> None:
    interval = 0.02

    async def main() -> tuple[list[str], list[tuple[float, str]]]:
        task = asyncio.create_task(sdnotify.watchdog_loop(interval, None))
        try:
            await _collect(manager, lambda g: len(_pings(g)) >= 3)
            # A ping is in the manager's queue as soon as sendto returns, so
            # after this drain anything queued was sent during the block.
            manager.drain()
            threading.Event().wait(interval * 15)  # block the loop, synchronously
            during = manager.drain()
            after = await _collect(manager, lambda g: len(_pings(g)) >= 1)
            return during, after
        finally:
            task.cancel()

    during, after = asyncio.run(main())
    assert during == []
    assert _pings(after), "pings resume once the loop runs again"


@pytest.mark.component
@pytest.mark.parametrize("manager", ["abstract"], indirect=True)
def test_watchdog_loop_keeps_pinging_when_the_status_callback_fails(
    manager: FakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("status bug")
        return "ok"

    async def main() -> list[tuple[float, str]]:
        task = asyncio.create_task(sdnotify.watchdog_loop(0.01, flaky))
        try:
            return await _collect(manager, lambda g: len(_pings(g)) >= 5)
        finally:
            task.cancel()

    with caplog.at_level(logging.ERROR, logger="supervisor.ops.sdnotify"):
        got = asyncio.run(main())
    assert calls["n"] >= 5
    assert [m for _, m in got if m.startswith("STATUS=")] == ["STATUS=ok"]
    assert "status bug" in caplog.text


@pytest.mark.pure
def test_watchdog_loop_rejects_a_nonpositive_interval() -> None:
    with pytest.raises(ValueError):
        asyncio.run(sdnotify.watchdog_loop(0, None))


# --------------------------------------------------------------------------
# Socket activation

_ACTIVATED_CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    sys.path.insert(0, sys.argv[1])
    from supervisor.ops import sdnotify

    names = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
    before = {k: os.environ.get(k) for k in names}
    pairs = sdnotify.listen_fds_with_names()
    after = {k: os.environ.get(k) for k in names}
    (name, sock), = pairs
    conn, _ = sock.accept()
    with conn:
        conn.sendall(json.dumps({
            "pid": os.getpid(),
            "fd": sock.fileno(),
            "name": name,
            "family": int(sock.family),
            "type": int(sock.type),
            "listening": sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN),
            "inheritable": os.get_inheritable(sock.fileno()),
            "before": before,
            "after": after,
        }).encode())
    """
)


@pytest.mark.process
@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed")
def test_listen_fds_takes_the_socket_systemd_socket_activate_passes(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_ACTIVATED_CHILD)
    tmpdir = _short_tmpdir()
    path = os.path.join(tmpdir, "ctl.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_"))}
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", path, "--fdname=control", sys.executable, str(script), str(REPO)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "socket never appeared"
            time.sleep(0.01)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            while True:  # the path exists from bind(); it answers from listen()
                try:
                    client.connect(path)
                    break
                except ConnectionRefusedError:
                    assert proc.poll() is None and time.monotonic() < deadline, "never listened"
                    time.sleep(0.01)
            chunks = []
            while chunk := client.recv(65536):
                chunks.append(chunk)
        output, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, output.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)

    report = json.loads(b"".join(chunks))
    # In Accept=no mode systemd-socket-activate execs the child in place, so
    # the pid it announced in LISTEN_PID is the pid we started.
    assert report["pid"] == proc.pid
    assert report["before"] == {"LISTEN_PID": str(proc.pid), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "control"}
    assert report["after"] == {"LISTEN_PID": None, "LISTEN_FDS": None, "LISTEN_FDNAMES": None}
    assert report["fd"] == sdnotify.SD_LISTEN_FDS_START == 3
    assert report["name"] == "control"
    assert (report["family"], report["type"]) == (socket.AF_UNIX, socket.SOCK_STREAM)
    assert report["listening"] == 1
    assert report["inheritable"] is False


_PID_CHECK_CHILD = textwrap.dedent(
    """
    import json, os, socket, sys
    sys.path.insert(0, sys.argv[1])
    from supervisor.ops import sdnotify

    # A listening socket at fd 3, inheritable, as a parent would leave it.
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    if lsock.fileno() != 3:
        os.dup2(lsock.fileno(), 3)
    os.set_inheritable(3, True)  # dup2 onto itself would not set it
    out = {}

    # Variables inherited from an activated parent: not ours.
    os.environ.update(LISTEN_PID=str(os.getppid()), LISTEN_FDS="1", LISTEN_FDNAMES="x")
    got = sdnotify.listen_fds()
    out["mismatch"] = {
        "count": len(got),
        "env": [os.environ.get(k) for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")],
        "fd3_inheritable": os.get_inheritable(3),
    }

    # The same fd with LISTEN_PID naming us is taken: the setup above can
    # tell a right implementation from a wrong one.
    os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
    got = sdnotify.listen_fds()
    out["match"] = {
        "count": len(got),
        "family": [int(s.family) for s in got],
        "fd3_inheritable": os.get_inheritable(3),
    }
    out["second_call"] = len(sdnotify.listen_fds())
    print(json.dumps(out))
    """
)


@pytest.mark.process
def test_listen_fds_ignores_sockets_meant_for_another_pid(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(_PID_CHECK_CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    done = subprocess.run(
        [sys.executable, str(script), str(REPO)], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["mismatch"] == {"count": 0, "env": [None, None, None], "fd3_inheritable": True}
    assert out["match"] == {"count": 1, "family": [socket.AF_INET], "fd3_inheritable": False}
    assert out["second_call"] == 0


@pytest.mark.pure
@pytest.mark.parametrize(
    "env",
    [
        {},
        {"LISTEN_FDS": "1"},
        {"LISTEN_PID": "self", "LISTEN_FDS": "many"},
        {"LISTEN_PID": "self", "LISTEN_FDS": "0"},
        {"LISTEN_PID": "oops", "LISTEN_FDS": "1"},
    ],
)
def test_listen_fds_without_a_valid_handover_returns_nothing(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    # None of these may touch fd 3 (which is pytest's, here), and all clear
    # the variables.
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, str(os.getpid()) if value == "self" else value)
    assert sdnotify.listen_fds() == []
    assert not any(v in os.environ for v in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"))


# --------------------------------------------------------------------------
# Journal logging


@pytest.mark.pure
def test_journal_stderr_matches_device_and_inode(monkeypatch: pytest.MonkeyPatch) -> None:
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert sdnotify.journal_stderr() is True
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
    assert sdnotify.journal_stderr() is False
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert sdnotify.journal_stderr() is False
    monkeypatch.delenv("JOURNAL_STREAM")
    assert sdnotify.journal_stderr() is False


@pytest.mark.pure
@pytest.mark.parametrize(
    ("level", "prefix"),
    [
        (logging.CRITICAL, "<2>"),
        (logging.ERROR, "<3>"),
        (logging.WARNING, "<4>"),
        (logging.INFO, "<6>"),
        (logging.DEBUG, "<7>"),
        (5, "<7>"),
    ],
)
def test_journal_formatter_prefixes_every_line(level: int, prefix: str) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("sessiond.x", level, __file__, 1, "two\nlines", None, exc_info)
    lines = sdnotify.JournalFormatter().format(record).split("\n")
    assert len(lines) > 3  # the message's line plus a traceback
    assert all(line.startswith(prefix) for line in lines), lines
    assert lines[0] == prefix + "sessiond.x: two\\nlines"  # (one line: a message cannot make lines of its own)
    assert lines[-1] == prefix + "  | ValueError: boom"


@pytest.fixture
def clean_root_logger() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield root
    finally:
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)


@pytest.mark.pure
def test_configure_logging_uses_priorities_only_on_the_journal_stream(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clean_root_logger: logging.Logger
) -> None:
    log_file = tmp_path / "stderr"
    with open(log_file, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        sdnotify.configure_logging(logging.INFO, stream)
        logging.getLogger("sessiond.test").warning("to the journal")
        logging.getLogger("sessiond.test").debug("filtered out")

        monkeypatch.delenv("JOURNAL_STREAM")
        sdnotify.configure_logging("DEBUG", stream)
        logging.getLogger("sessiond.test").debug("to a terminal")

    ours = [h for h in clean_root_logger.handlers if isinstance(h, logging.StreamHandler) and h.stream is stream]
    assert len(ours) == 1, "a second call replaces the handler"
    lines = log_file.read_text().splitlines()
    assert lines[0] == "<4>sessiond.test: to the journal"
    assert len(lines) == 2
    assert not lines[1].startswith("<")
    assert lines[1].endswith(" DEBUG sessiond.test: to a terminal")


@pytest.mark.process
def test_sdnotify_module_has_no_third_party_imports() -> None:
    # The glue must work before the venv's packages load (and in a minimal
    # unit test of the daemon); check that importing it alone pulls nothing in
    # (ipc: its logfields, standard library only).
    code = (
        "import sys; before = set(sys.modules); import supervisor.ops.sdnotify; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "std = sys.stdlib_module_names; "
        "print(sorted(m for m in new if m not in std and m not in ('supervisor', 'ipc')))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


