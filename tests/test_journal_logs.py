"""Logs for machines: under journald the daemon's and the workers' records
go to the journal's socket as fields (a datagram socket this test binds
stands in for journald: SESSIOND_JOURNAL_SOCKET, tests only), a large entry
in a sealed memfd, and a journal that cannot take one now costs nothing but
that record's `<N>` line; `[daemon] log_format = "json"` prints the same
fields as JSON lines; `sessionctl logs` keeps a session's lifecycle across
a daemon restart (SIGKILL), compaction included."""

from __future__ import annotations

import array
import contextlib
import fcntl
import io
import json
import logging
import os
import select
import socket
import threading
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from harness import FAST_SWEEP, Daemon, wait_for
from ipc import logfields as journal
from test_operator_ctl import OPERATOR_CONFIG, _create


def parse_entry(data: bytes) -> dict[str, str]:
    """An entry of journald's native protocol, as journald reads it."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        newline = data.index(b"\n", pos)
        equals = data.find(b"=", pos, newline)
        if equals >= 0:
            fields[data[pos:equals].decode()] = data[equals + 1:newline].decode()
            pos = newline + 1
        else:
            key = data[pos:newline].decode()
            (size,) = struct.unpack_from("<Q", data, newline + 1)
            start = newline + 9
            fields[key] = data[start:start + size].decode()
            assert data[start + size:start + size + 1] == b"\n"
            pos = start + size + 1
    return fields


@pytest.fixture
def journal_socket() -> Iterator[socket.socket]:
    where = Path(tempfile.mkdtemp(prefix="sdj-"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(where / "socket"))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    try:
        yield sock
    finally:
        sock.close()
        (where / "socket").unlink(missing_ok=True)
        where.rmdir()


@contextlib.contextmanager
def read_as_journald(sock: socket.socket) -> Iterator[None]:
    """Read `sock` all the time, as journald does, while a daemon logs to
    it: a datagram socket queues only net.unix.max_dgram_qlen datagrams
    (10 by default), and past them a sender gets EAGAIN and falls back to
    its stream.  `receive` then hands out what the reader got."""
    arrived: list[dict[str, str]] = []
    _ARRIVED[sock.fileno()] = arrived
    stop_r, stop_w = os.pipe()
    reader = threading.Thread(target=_read_journal, args=(sock, stop_r, arrived), daemon=True)
    reader.start()
    try:
        yield
    finally:
        os.write(stop_w, b"x")
        reader.join(10)
        os.close(stop_r)
        os.close(stop_w)
        del _ARRIVED[sock.fileno()]


_ARRIVED: dict[int, list[dict[str, str]]] = {}


def _read_journal(sock: socket.socket, stop: int, arrived: list[dict[str, str]]) -> None:
    while True:
        ready, _, _ = select.select([sock, stop], [], [])
        if stop in ready:
            return
        arrived.extend(_drain(sock))


def receive(sock: socket.socket, entries: list[dict[str, str]]) -> list[dict[str, str]]:
    """Whatever has arrived, read by the fixture's reader or now."""
    arrived = _ARRIVED.get(sock.fileno())
    if arrived is None:
        entries.extend(_drain(sock))
        return entries
    entries.extend(arrived[len(entries):])
    return entries


def _drain(sock: socket.socket) -> list[dict[str, str]]:
    """What is queued on `sock` (memfds read as journald does)."""
    out: list[dict[str, str]] = []
    sock.setblocking(False)
    while True:
        try:
            data, ancdata, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4))
        except BlockingIOError:
            return out
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fd = array.array("i", payload[:4])[0]
                try:
                    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_SHRINK, seals
                    data = os.pread(fd, os.fstat(fd).st_size, 0)
                finally:
                    os.close(fd)
        out.append(parse_entry(data))


@pytest.mark.process
def test_under_journald_records_are_sent_as_fields_to_its_socket(
    make_daemon, journal_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    d: Daemon = make_daemon(OPERATOR_CONFIG, start=False)
    d.log_path.touch()  # the daemon's stderr: journald's stream
    st = os.stat(d.log_path)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    monkeypatch.setenv("SESSIOND_JOURNAL_SOCKET", journal_socket.getsockname())
    with read_as_journald(journal_socket):
        _logged_as_fields(d, journal_socket)


def _logged_as_fields(d: Daemon, journal_socket: socket.socket) -> None:
    d.start()
    sid = _create(d, "operator_handlers:broken")
    assert d.ctl("send", sid, "x").returncode == 1  # its worker logs a traceback

    entries: list[dict[str, str]] = []

    def about(sid: str) -> list[dict[str, str]]:
        return [e for e in receive(journal_socket, entries) if e.get("SESSION_ID") == sid]

    wait_for(lambda: any(e.get("LOGGER") == "sessiond.worker" for e in about(sid)), 10, "the worker's entry")
    wait_for(lambda: any(e.get("SESSIOND_EVENT") == "turn_failed" for e in about(sid)), 10, "the daemon's")
    start = next(e for e in entries if "listening on" in e["MESSAGE"])
    assert start["PRIORITY"] == "6" and start["SYSLOG_IDENTIFIER"] == "sessiond" and "SESSION_ID" not in start
    assert start["CODE_FILE"].endswith("daemon.py") and int(start["CODE_LINE"]) > 0 and start["CODE_FUNC"]

    # The worker's failure, with its traceback: a value with newlines.
    worker = next(e for e in about(sid) if e["LOGGER"] == "sessiond.worker" and "turn 1 failed" in e["MESSAGE"])
    assert worker["PRIORITY"] == "3" and "Traceback" in worker["MESSAGE"] and "\n" in worker["MESSAGE"]
    assert worker["MESSAGE"].startswith(f"session={sid} ") and int(worker["SESSION_UID"]) >= 0

    # The daemon's lifecycle lines: the event, the state, the uids.
    ready = next(e for e in about(sid) if e.get("SESSIOND_EVENT") == "state" and e["SESSION_STATE"] == "idle")
    assert ready["PRIORITY"] == "6" and ready["CODE_FILE"].endswith("events.py")
    assert int(ready["SESSION_OWNER_UID"]) == os.geteuid() and int(ready["SESSION_UID"]) >= 0
    failed = next(e for e in about(sid) if e.get("SESSIOND_EVENT") == "turn_failed")
    assert "aborted turn 1" in failed["MESSAGE"]

    # Nothing of that went down the stream as well.
    assert "listening on" not in d.log and f"session={sid}" not in d.log


@pytest.mark.component
def test_a_large_entry_goes_in_a_sealed_memfd_and_a_full_journal_costs_one_line(
    journal_socket: socket.socket,
) -> None:
    stream = io.StringIO()
    fallback = logging.StreamHandler(stream)
    fallback.setFormatter(logging.Formatter("<%(levelno)s>%(message)s"))
    handler = journal.JournalHandler(journal_socket.getsockname(), fallback=fallback)
    logger = logging.getLogger("sessiond.test-journal")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        big = "x" * (3 << 20)  # past any datagram's size
        logger.warning("big %s", big, extra={"session_id": "s1", "sessiond_event": "state"})
        (entry,) = receive(journal_socket, [])
        assert entry["MESSAGE"] == f"big {big}" and entry["SESSION_ID"] == "s1" and entry["PRIORITY"] == "4"
        assert stream.getvalue() == ""

        # A journal that does not read: the socket's queue fills, and each
        # record it cannot take now goes down the stream instead, at once.
        journal_socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        for i in range(2000):
            logger.info("line %d", i)
            if stream.getvalue():
                break
        assert stream.getvalue().startswith("<20>line "), stream.getvalue()[:80]
    finally:
        logger.removeHandler(handler)
        handler.close()


@pytest.mark.process
def test_json_log_format_prints_one_object_a_line_with_the_same_fields(make_daemon) -> None:
    d: Daemon = make_daemon(OPERATOR_CONFIG.replace("[daemon]\n", '[daemon]\nlog_format = "json"\n'))
    sid = _create(d, "operator_handlers:broken")
    assert d.ctl("send", sid, "x").returncode == 1
    wait_for(lambda: "aborted turn 1" in d.log and "Traceback" in d.log, 10, "the failure in the log")
    lines = [json.loads(line) for line in d.log.splitlines() if line]  # every line is JSON
    for obj in lines:
        assert {"TIMESTAMP", "PRIORITY", "MESSAGE", "LOGGER", "PID", "CODE_FILE"} <= set(obj), obj
        assert obj["TIMESTAMP"].endswith("Z") and isinstance(obj["PRIORITY"], int)
    ready = next(o for o in lines if o.get("SESSION_ID") == sid and o.get("SESSION_STATE") == "idle")
    assert ready["SESSIOND_EVENT"] == "state" and ready["SESSION_OWNER_UID"] == os.geteuid()
    worker = next(o for o in lines if o["LOGGER"] == "sessiond.worker" and "turn 1 failed" in o["MESSAGE"])
    assert worker["SESSION_ID"] == sid and worker["PRIORITY"] == 3 and "Traceback" in worker["MESSAGE"]

    # A zygote started by exec (the first one died) logs JSON too.
    first = _zygote(d)
    assert first is not None
    first.kill()
    wait_for(lambda: (z := _zygote(d)) is not None and z.pid != first.pid, 10, "a new zygote")
    again = wait_for(lambda: _try_create_broken(d), 10, "a session on the new zygote")
    assert d.ctl("send", again, "x").returncode == 1
    wait_for(lambda: f"session={again} turn 1 failed" in d.log, 10, "its worker's failure")
    lines = [json.loads(line) for line in d.log.splitlines() if line]
    assert any(o.get("SESSION_ID") == again and o["LOGGER"] == "sessiond.worker" for o in lines)


def _zygote(d: Daemon) -> psutil.Process | None:
    try:
        kids = [k for k in psutil.Process(d.pid).children() if k.status() != psutil.STATUS_ZOMBIE]
        return kids[0] if len(kids) == 1 else None
    except psutil.Error:
        return None


def _try_create_broken(d: Daemon) -> str | None:
    done = d.ctl("create", "--handler", "operator_handlers:broken")
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.process
def test_logs_keep_the_lifecycle_across_a_daemon_restart(make_daemon) -> None:
    config = FAST_SWEEP.replace("[agent.worker]\n", "[agent.worker]\nsnapshot_every_turns = 1\n")
    d: Daemon = make_daemon(config)
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:crash_mid_turn").id
        assert type(list(c.send(sid, "crash"))[-1]).__name__ == "TurnFailed"
        wait_for(lambda: c.status(sid).state == "idle" and c.status(sid).restarts == 1, 10, "the restart")
        assert c.send_text(sid, "one") == "1: one"  # a snapshot folds the log's records in
    wait_for(lambda: (d.state_dir / "sessions" / sid / "snapshot").exists(), 10, "the snapshot")
    before = json.loads(d.ctl("--json", "logs", sid).stdout)["entries"]
    assert ("state", "crashed") in [(e["type"], e.get("new")) for e in before]
    d.kill()  # SIGKILL: no goodbye

    again = make_daemon(config, root=d.root)
    done = again.ctl("--json", "logs", sid)
    assert done.returncode == 0, done.stderr
    after = json.loads(done.stdout)["entries"]
    kinds = [(e["type"], e.get("new") or "") for e in after]
    assert ("state", "crashed") in kinds and ("state", "restarting") in kinds and ("turn_failed", "") in kinds
    # Each as it was, at its time; a turn's own running and back are the
    # ones not kept (the turns themselves are in `history`).
    turn = {"running", "interrupting"}
    kept = [e for e in before
            if not (e["type"] == "state" and (e["new"] in turn or (e["old"] in turn and e["new"] == "idle")))]
    assert after == kept
    text = again.ctl("logs", sid).stdout
    assert "crashed" in text and "last exit: " in text
    # And it goes on: this daemon's events come after the kept ones.
    with again.client() as c:
        assert c.send_text(sid, "two") == "2: two"
    later = json.loads(again.ctl("--json", "logs", sid).stdout)["entries"]
    assert later[:len(after)] == after and ("state", "starting") in [(e["type"], e.get("new")) for e in later[len(after):]]


@pytest.mark.process
def test_the_span_exporter_s_errors_reach_the_journal_as_errors(journal_socket: socket.socket, tmp_path: Path) -> None:
    # The span exporter process (docs/tracing.md) alone, its stderr journald's
    # stream, told to export to a port where nothing listens.
    import subprocess
    import sys

    import msgspec

    from harness import env_for_children
    from supervisor.ops.otel import ExportSpan

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    stderr = tmp_path / "stderr"
    stderr.touch()
    st = os.stat(stderr)
    env = {**env_for_children(), "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}",
           "SESSIOND_JOURNAL_SOCKET": journal_socket.getsockname(), "SESSIOND_LOG_FORMAT": "text"}
    settings = json.dumps({"exporter": "otlp", "endpoint": f"http://127.0.0.1:{closed}/v1/traces",
                           "export_timeout_secs": 1})
    span = ExportSpan((7).to_bytes(16, "big"), 5, 0, False, "invoke_agent agent", 1, 10, 20, "", {}, [], False)
    body = msgspec.msgpack.encode([span])
    with stderr.open("ab") as err:
        done = subprocess.run([sys.executable, "-P", "-m", "supervisor.ops.otel_export", settings],
                              input=len(body).to_bytes(4, "big") + body, stdout=subprocess.DEVNULL, stderr=err,
                              env=env, timeout=120)  # ~1 s at rest, 30 s beside 8 busy loops
    assert done.returncode == 0
    entries = receive(journal_socket, [])
    failed = [e for e in entries if e["LOGGER"].startswith("opentelemetry.exporter")]
    assert failed, (entries, stderr.read_text())
    assert all(e["PRIORITY"] == "3" and e["SYSLOG_IDENTIFIER"] == "sessiond" for e in failed)
    assert stderr.read_text() == "", "nothing as plain lines (journald would store them at info)"
