"""A session at rest costs the daemon no file descriptor (issue 32): with
sessions hibernated to make room, only the live ones hold their files open
(fence and log), a revived one takes them again, and after a daemon restart
every session loads without keeping one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from conftest import FAST_CONFIG
from harness import Daemon, wait_for

pytestmark = pytest.mark.process

LIVE = 3
CONFIG = FAST_CONFIG + f"""
[agent.limits]
max_concurrent_sessions = {LIVE}
"""


def _fds_by_session(d: Daemon) -> dict[str, int]:
    """The daemon's open fds into each session's directory."""
    sessions = d.state_dir / "sessions"
    out: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        with contextlib.suppress(OSError):
            target = Path(os.readlink(f"/proc/{d.pid}/fd/{fd}"))
            if target.parent.parent == sessions and not target.parent.name.startswith("."):
                out[target.parent.name] = out.get(target.parent.name, 0) + 1
    return out


def test_hibernated_and_loaded_sessions_hold_no_fd(make_daemon) -> None:
    d: Daemon = make_daemon(CONFIG)
    with d.client() as c:
        sids = [c.create(session=f"s{i:02d}", handler="echo").id for i in range(4 * LIVE)]
        c.send_text(sids[-1], "hello")

        def states() -> dict[str, str]:
            return {s.id: s.state for s in c.list()}

        # Every create past the ceiling hibernated the least recently used.
        wait_for(lambda: list(states().values()).count("hibernated") == 3 * LIVE, what="room made")
        resting = {sid for sid, state in states().items() if state == "hibernated"}
        held = _fds_by_session(d)
        assert not resting & held.keys(), held  # hibernated: none
        assert len(held) <= LIVE and all(n <= 2 for n in held.values()), held  # live: fence and log
        # A revived session writes again (its input, its turn), then rests.
        old = sorted(resting)[0]
        assert c.send_text(old, "back") == "1: back"
        c.stop(old)
        wait_for(lambda: old not in _fds_by_session(d), what="a stopped session's files closed")
    d.kill()
    d.start()
    with d.client() as c:
        assert len(c.list()) == 4 * LIVE
        assert _fds_by_session(d) == {}  # every session loaded, none holding a file
        assert c.send_text(sids[1], "again") == "1: again"
