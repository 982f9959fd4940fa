"""The real daemon under systemd's protocols, without systemd: started by
systemd-socket-activate on the first connection, reporting to a fake
$NOTIFY_SOCKET (READY, STATUS, WATCHDOG, STOPPING), reloading its config on
SIGHUP.  test_sdnotify.py checks the helpers one by one; here the daemon
process itself is on trial."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from conftest import FAST_CONFIG
from harness import REPO, TESTS, Daemon, _alive, env_for_children, trusting, wait_for

pytestmark = pytest.mark.process

_UCRED = struct.Struct("3i")


class NotifyListener:
    """The service manager's end of $NOTIFY_SOCKET, with the sender's pid
    from SCM_CREDENTIALS, as systemd checks it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.log: list[tuple[float, int, list[str]]] = []  # (monotonic, pid, fields)

    def recv(self, timeout: float) -> tuple[float, int, list[str]] | None:
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        except (TimeoutError, BlockingIOError):
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _UCRED.unpack(payload[: _UCRED.size])[0]
        item = (time.monotonic(), pid, data.decode().split("\n"))
        self.log.append(item)
        return item

    def wait_for_field(self, prefix: str, timeout: float) -> tuple[float, int, list[str]]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {prefix!r} within {timeout}s; got {self.log}")
            item = self.recv(left)
            if item is not None and any(f.startswith(prefix) for f in item[2]):
                return item

    def collect(self, secs: float) -> list[tuple[float, int, list[str]]]:
        deadline = time.monotonic() + secs
        out = []
        while (left := deadline - time.monotonic()) > 0:
            item = self.recv(left)
            if item is not None:
                out.append(item)
        return out

    def drain(self) -> list[tuple[float, int, list[str]]]:
        out = []
        while (item := self.recv(0.001)) is not None:
            out.append(item)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _watchdogs(items: list[tuple[float, int, list[str]]]) -> list[float]:
    return [t for t, _, fields in items if "WATCHDOG=1" in fields]


# ---------------------------------------------------------------- (a) socket activation


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                    reason="systemd-socket-activate is not installed (package systemd)")
def test_socket_activation_starts_the_daemon_on_the_first_connection(tmp_path: Path, sockdir: Path) -> None:
    from supervisor.ctl.client import Client

    path = sockdir / "ctl.sock"
    config = tmp_path / "config.toml"
    config.write_text(trusting(FAST_CONFIG))
    state = tmp_path / "state"
    pythonpath = os.pathsep.join([str(REPO), str(TESTS)])
    # systemd-socket-activate passes only a few variables on (PATH, HOME, ...)
    # plus LISTEN_*: the rest must be named with -E.
    cmd = ["systemd-socket-activate", "-l", str(path), "-E", f"PYTHONPATH={pythonpath}",
           sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(state),
           "--config", str(config)]
    log = open(tmp_path / "activate.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_for_children(),
                            start_new_session=True)
    log.close()
    seen: set[int] = set()
    try:
        wait_for(lambda: path.exists() or proc.poll() is not None, 10, "the listening socket")
        assert proc.poll() is None, (tmp_path / "activate.log").read_text()
        # Nothing but the activator runs until somebody connects.
        assert psutil.Process(proc.pid).cmdline()[0].endswith("systemd-socket-activate")
        assert not psutil.Process(proc.pid).children()
        with Client(path) as c:  # the Hello waits in the inherited socket's queue
            # Accept=no: the activator execs the daemon in place, same pid.
            assert c._client.server_pid == proc.pid
            seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            sid = c.create("activated", handler="echo").id
            assert c.send_text(sid, "through the inherited socket") == "1: through the inherited socket"
            seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
        # The activator's pid now runs the daemon (named by its process title).
        assert " ".join(psutil.Process(proc.pid).cmdline()).strip() == "sessiond: daemon"
        assert (state / "sessions" / "activated").is_dir()
        # The daemon did not make a socket of its own anywhere.
        text = (tmp_path / "activate.log").read_text()
        assert f"listening on {path}" in text, text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, (tmp_path / "activate.log").read_text()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                seen.update(p.pid for p in psutil.Process(proc.pid).children(recursive=True))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    assert seen, "the daemon had a zygote at least"
    wait_for(lambda: not [p for p in seen if _alive(p)], 5, "no process left behind")


# ---------------------------------------------------------------- (b) sd_notify


def _start_with_env(d: Daemon, extra: dict[str, str]) -> None:
    """Daemon.start, with systemd's variables that env_for_children drops."""
    env = env_for_children()
    env.pop("WATCHDOG_PID", None)
    env.update(extra)
    log = open(d.log_path, "ab")
    d.proc = subprocess.Popen(d.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True, cwd=str(d.root))
    log.close()
    d.known_pids.add(d.proc.pid)


def test_ready_status_watchdog_stopping_and_silence_while_stopped(make_daemon, sockdir: Path) -> None:
    listener = NotifyListener(str(sockdir / "notify"))
    d = make_daemon(start=False)
    try:
        _start_with_env(d, {"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "400000"})
        _, pid, fields = listener.wait_for_field("READY=1", 20)
        # READY means the socket already accepts: connect at once, no retry.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(d.socket))
        with d.client() as c:
            assert c.ping().pid == d.pid
        assert pid == d.pid, "notifications must come from the main pid (NotifyAccess=main)"
        status = [f for f in fields if f.startswith("STATUS=")]
        assert status and "sessions" in status[0], fields
        assert len([i for i in listener.log if "READY=1" in i[2]]) == 1

        # Half of WATCHDOG_USEC=400000: a ping every 0.2 s.  How regular
        # they come is the scheduler's on a busy machine: the test asks that
        # they keep coming, more often than the watchdog would fire at.
        items = listener.collect(1.5)
        beats = _watchdogs(items)
        assert len(beats) >= 3, items
        gaps = [b - a for a, b in zip(beats, beats[1:])]
        assert statistics.median(gaps) < 0.4, gaps
        assert {p for _, p, _ in items} == {d.pid}

        with d.client() as c:
            c.create("one", handler="echo")
        # (A status sent while it starts says 0 live; the next one 1.)
        listener.wait_for_field("STATUS=1 sessions: 1 live", 10)

        # A stopped daemon does not ping; a continued one does again.
        os.kill(d.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(d.pid).status() == psutil.STATUS_STOPPED, 5, "SIGSTOP")
        listener.drain()  # anything sent before the stop
        silent = listener.collect(1.0)
        assert _watchdogs(silent) == [], silent
        os.kill(d.pid, signal.SIGCONT)
        for _ in range(2):
            listener.wait_for_field("WATCHDOG=1", 10)

        d.signal(signal.SIGTERM)
        _, pid, _ = listener.wait_for_field("STOPPING=1", 10)
        assert pid == d.pid
        assert d.proc is not None and d.proc.wait(20) == 0
    finally:
        listener.close()


# ---------------------------------------------------------------- (c) SIGHUP


def test_sighup_applies_a_valid_config_and_keeps_the_old_one_on_error(make_daemon) -> None:
    base = FAST_CONFIG + "\n[agent.limits]\nmax_memory_mb = 512\n"
    d = make_daemon(base)
    with d.client() as c:
        sid = c.create("survivor", handler="echo").id
        assert c.send_text(sid, "a") == "1: a"
    ok = d.ctl("create", "--id", "at512", "--handler", "echo", "--set", "agent.limits.max_memory_mb=512")
    assert ok.returncode == 0, ok.stderr

    d.config_path.write_text(base.replace("max_memory_mb = 512", "max_memory_mb = 256"))
    d.signal(signal.SIGHUP)
    wait_for(lambda: "config reloaded" in d.log, 10, "the reload")
    refused = d.ctl("create", "--handler", "echo", "--set", "agent.limits.max_memory_mb=512")
    assert refused.returncode == 2, refused  # a bad --set is usage
    assert "above the operator's limit of 256" in refused.stderr, refused.stderr
    fits = d.ctl("create", "--id", "at200", "--handler", "echo", "--set", "agent.limits.max_memory_mb=200")
    assert fits.returncode == 0, fits.stderr

    # A broken config is refused, named, and the running one kept.
    d.config_path.write_text(base.replace("max_memory_mb = 512", "max_memroy_mb = 128"))
    d.signal(signal.SIGHUP)
    wait_for(lambda: "reload refused" in d.log, 10, "the refused reload")
    line = next(ln for ln in d.log.splitlines() if "reload refused" in ln)
    assert "agent.limits.max_memroy_mb" in line and str(d.config_path) in line, line
    assert "ERROR" in line
    still = d.ctl("create", "--handler", "echo", "--set", "agent.limits.max_memory_mb=512")
    assert still.returncode == 2 and "above the operator's limit of 256" in still.stderr, still
    d.config_path.write_text("[agent\nnot toml")
    d.signal(signal.SIGHUP)
    wait_for(lambda: "not valid TOML" in d.log, 10, "the second refused reload")

    with d.client() as c:
        assert c.ping().pid == d.pid
        assert {s.id for s in c.list()} == {"survivor", "at512", "at200"}
        assert c.send_text(sid, "b") == "2: b"
        assert c.send_text("at512", "x") == "1: x"
        assert c.status(sid).restarts == 0


def test_every_daemon_line_about_a_session_carries_session_id(make_daemon) -> None:
    # `journalctl -u sessiond --grep 'session=ID'` must find the daemon's lines
    # about a session as well as its worker's: created, crashed, restarted,
    # state changes (debug), deleted.
    d = make_daemon(FAST_CONFIG + 'log_level = "debug"\n')
    sid = "grepme7"
    with d.client() as c:
        c.create(session=sid, handler="fixture_handlers:crash_mid_turn")
        events = list(c.send(sid, "crash"))
        assert type(events[-1]).__name__ == "TurnFailed", events
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).restarts == 1, 10,
                 "the restarted worker")
        c.remove(sid)
    wait_for(lambda: "deleted" in d.log, 10, "the deletion to be logged")
    about = [line for line in d.log.splitlines() if sid in line]
    # The daemon's own lines are there (not only the worker's) ...
    for what in ("created", "crashed", "deleted", "-> restarting"):
        assert any(what in line for line in about), (what, d.log)
    # ... and every one of them carries the field.
    untagged = [line for line in about if f"session={sid}" not in line]
    assert untagged == [], "\n".join(untagged)
