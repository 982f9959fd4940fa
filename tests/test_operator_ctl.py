"""What a new user sees through `sessionctl`, against a real daemon: replies
that were not streamed, Ctrl-C, tool calls, permission prompts, exit codes,
--version and --help."""

from __future__ import annotations

import pytest

from conftest import FAST_CONFIG
from harness import Daemon

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
    # The README's Counter: streams "counting… ", returns the reply unstreamed.
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
