"""Text logs cannot be forged: what a client, a handler or a tool writes
into a log record (a reason, an exception that quotes its input) is
escaped to one line, and a traceback is a block whose every line is
marked as the record's continuation (ipc.logfields.TextFormatter)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from harness import Daemon, wait_for
from ipc.logfields import CONTINUED, PriorityFormatter
from supervisor.ops.sdnotify import configure_logging

FORGED = "2099-01-01 00:00:00,000 INFO sessiond.manager: session=victim deleted"
HOSTILE = f"x\n{FORGED}\r\x1b[2J\x1b[31mred"
# A line of a record: "YYYY-MM-DD hh:mm:ss,mmm LEVEL logger: ...", or a continuation.
_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ")


def _forged_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("2099-01-01") or "\x1b" in line or "\r" in line]


@pytest.mark.component
def test_a_message_and_a_traceback_that_quote_their_input_stay_inside_their_record() -> None:
    stream = io.StringIO()
    handler = configure_logging(logging.INFO, stream=stream)
    try:
        log = logging.getLogger("sessiond.test")
        log.info("aborted turn 1: %s", HOSTILE)
        try:
            raise ValueError(f"cannot parse {HOSTILE}")
        except ValueError:
            log.error("turn 1 failed", exc_info=True)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    text = stream.getvalue()
    assert not _forged_lines(text), text
    for line in text.splitlines():
        assert _RECORD.match(line) or line.startswith(CONTINUED), line
    assert "aborted turn 1: x\\n2099-01-01" in text and "\\x1b[31mred" in text
    # journald's stream (no native socket): each line its priority, none forged.
    record = logging.LogRecord("sessiond.test", logging.ERROR, __file__, 1, "reason: %s", (HOSTILE,), None)
    lines = PriorityFormatter("%(name)s: %(message)s").format(record).splitlines()
    assert lines == [f"<3>sessiond.test: reason: x\\n{FORGED}\\r\\x1b[2J\\x1b[31mred"]


@pytest.mark.process
def test_a_handler_exception_quoting_a_client_s_input_forges_no_line_of_the_daemon_s_log(make_daemon) -> None:
    d: Daemon = make_daemon()
    sid = d.ctl("create", "--handler", "fixture_handlers:quotes_its_input").stdout.strip()
    assert d.ctl("send", sid, HOSTILE).returncode == 1
    # The worker's traceback and the daemon's "aborted turn" line both quote it.
    wait_for(lambda: "aborted turn 1" in d.log and "Traceback" in d.log, 10, "the failure in the log")
    assert not _forged_lines(d.log), _forged_lines(d.log)
    assert "cannot parse x\\n2099-01-01" in d.log
