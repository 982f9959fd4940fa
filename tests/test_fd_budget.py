"""File descriptors have a budget: per session, each worker and its tools
hold at most `[agent.limits] max_open_files`, soft and hard."""

from __future__ import annotations

import errno

import pytest

from harness import Daemon


@pytest.mark.process
def test_a_session_cannot_open_more_fds_than_max_open_files_nor_raise_it(tmp_path) -> None:
    d = Daemon(tmp_path / "d", "[daemon]\nspare_workers = 0\n[agent.limits]\nmax_open_files = 100\n")
    d.start()
    try:
        with d.client() as c:
            sid = c.create(handler="fixture_handlers:whoami",
                           settings={"agent.limits.max_open_files": 80}).id
            reply = c.send_text(sid, "fds")
            head, _, tool = reply.partition(" tool=")
            worker = head.removeprefix("worker=")
            assert worker == "80,80"  # the handler's own, soft and hard: the override, under the operator's 100
            raised, err, opened, soft, hard = tool.split()
            assert raised == "kept" and (soft, hard) == ("80", "80")
            assert int(err) == errno.EMFILE and int(opened) < 80
            # The operator's value is a ceiling: a session may not ask for more.
            from supervisor.ctl.client import RequestError

            with pytest.raises(RequestError):
                c.create(handler="echo", settings={"agent.limits.max_open_files": 4096})
    finally:
        d.stop()
