"""What an operator sees of the processes: a handler's failure in the log
(traceback, session id) and in the client's message (where it broke), and
the processes named in `ps`."""

from __future__ import annotations

import psutil
import pytest

from harness import Daemon, wait_for
from test_operator_ctl import OPERATOR_CONFIG, _create

pytestmark = pytest.mark.process


def test_a_handler_exception_is_logged_with_traceback_and_located_for_the_client(
    make_daemon,
) -> None:
    d: Daemon = make_daemon(OPERATOR_CONFIG)  # log_level is the default, info
    sid = _create(d, "operator_handlers:broken")
    r = d.ctl("send", sid, "x")
    assert r.returncode == 1
    # The client hears what and where: the last frame, the line that raised.
    assert "KeyError: 'missing' (at operator_handlers.py:" in r.stderr, r.stderr
    assert " in _lookup)" in r.stderr
    # The operator's log has the whole traceback, at error level, with the id.
    wait_for(lambda: "Traceback" in d.log, 5.0, f"a traceback in the log:\n{d.log}")
    lines = d.log.splitlines()
    failed = [line for line in lines if "turn 1 failed" in line]
    assert failed and f"session={sid}" in failed[0] and "ERROR" in failed[0], d.log
    assert any("return table[key]" in line for line in lines)


def test_ps_names_the_daemon_the_zygote_and_each_worker(make_daemon) -> None:
    d: Daemon = make_daemon(OPERATOR_CONFIG)
    sid = _create(d, "echo")
    with d.client() as c:
        worker_pid = c.status(sid).pid

    def title(pid: int) -> str:
        return " ".join(psutil.Process(pid).cmdline()).strip()

    assert title(d.pid) == "sessiond: daemon"
    assert title(worker_pid) == "sessiond: worker (booted)"  # (no session id: every user sees titles)
    children = psutil.Process(d.pid).children()
    assert [title(p.pid) for p in children] == ["sessiond: zygote"]
    # Spares wait for a session, and say so.
    wait_for(lambda: any(title(p.pid) == "sessiond: worker (spare)" for p in children[0].children()),
             5.0, "a spare worker")


def test_on_the_journal_every_line_has_its_priority_and_no_timestamp(
    make_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import re

    d: Daemon = make_daemon(OPERATOR_CONFIG, start=False)
    d.log_path.touch()  # the daemon's stderr: make it the "journal stream"
    st = os.stat(d.log_path)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    # No journal socket (tests/test_journal_logs.py has the one with): the
    # `<N>` stream, whether or not this host runs journald.
    monkeypatch.setenv("SESSIOND_JOURNAL_SOCKET", str(d.root / "no-journal-here"))
    d.start()
    sid = _create(d, "operator_handlers:broken")
    assert d.ctl("send", sid, "x").returncode == 1
    wait_for(lambda: "KeyError" in d.log, 5.0, "the failure in the log")
    lines = [line for line in d.log.splitlines() if line]
    assert all(re.match(r"<[0-7]>", line) for line in lines), lines
    assert not any(re.match(r"<\d>\d{4}-\d\d-\d\d", line) for line in lines), "the journal adds the time"
    assert any(line.startswith("<6>sessiond: ") for line in lines)
    failed = [line for line in lines if "turn 1 failed" in line]
    assert failed and failed[0].startswith(f"<3>sessiond.worker: session={sid} "), failed
    # The traceback's lines are errors too, so `journalctl -p err` shows them.
    assert any(line.startswith("<3>") and "return table[key]" in line for line in lines)
