"""A session at rest costs the daemon no file descriptor (issue 32): with
sessions hibernated to make room, only the live ones hold their files open
(fence and log), a revived one takes them again, and after a daemon restart
every session loads without keeping one.  A live one costs it at most
FDS_PER_LIVE_SESSION, however many processes it runs: the sweep holds a
session's /proc files only while it measures it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from conftest import FAST_CONFIG
from harness import FAST_SWEEP, TEST_HANDLERS, Daemon, wait_for
from supervisor.core.fdbudget import FDS_PER_LIVE_SESSION

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
        # The daemon answers while it loads its sessions in the background
        # (`ls` lists those loaded so far): the check comes once all are.
        wait_for(lambda: len(c.list()) == 4 * LIVE, what="every session loaded")
        assert _fds_by_session(d) == {}  # every session loaded, none holding a file
        assert c.send_text(sids[1], "again") == "1: again"


def _daemon_fds(d: Daemon) -> list[str]:
    """What each of the daemon's fds names."""
    out = []
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        with contextlib.suppress(OSError):
            out.append(os.readlink(f"/proc/{d.pid}/fd/{fd}"))
    return out


def test_a_live_sessions_processes_cost_the_daemon_no_proc_file(make_daemon) -> None:
    """Once the sweep has measured a session's worker and its three
    children, the daemon holds no /proc file of theirs (the old sweep kept
    statm, stat and children open for each process for as long as it
    lived: 12 more here) and, per child, only the pidfd it is killed by; a
    second live session costs the daemon at most FDS_PER_LIVE_SESSION."""
    handlers = ", ".join(f'"{h}"' for h in [*TEST_HANDLERS, "cgroup_handlers:*"])
    d: Daemon = make_daemon(FAST_SWEEP.replace("[daemon]\n", "[daemon]\nspare_workers = 0\n")
                            + f"\n[agent]\nallowed_handlers = [{handlers}]\n")
    proc_files = lambda: [t for t in _daemon_fds(d) if t.startswith("/proc/")]  # noqa: E731
    pidfds = lambda: _daemon_fds(d).count("anon_inode:[pidfd]")  # noqa: E731
    with d.client() as c:
        first = c.create(handler="cgroup_handlers:escaper").id
        assert c.send_text(first, "none yet") == "unknown: none"
        assert c.status(first).rss_bytes  # measured (by the sweep, or by status now)
        wait_for(lambda: not proc_files(), 10, "no /proc file held between measures")
        before = pidfds()
        assert c.send_text(first, "children 3") == "started 3"
        # The sweep takes a pidfd for each child it measures (so it can kill
        # one that leaves the worker's group): then it has read them.
        wait_for(lambda: pidfds() >= before + 3, 10, "the sweep to measure the children")
        wait_for(lambda: not proc_files() and pidfds() == before + 3, 10,
                 f"no /proc file held after the children were measured: {proc_files()}")
        one_live = len(_daemon_fds(d))
        second = c.create(handler="echo").id
        assert c.send_text(second, "hi") == "1: hi"
        assert c.status(second).rss_bytes
        wait_for(lambda: len(_daemon_fds(d)) - one_live <= FDS_PER_LIVE_SESSION, 10,
                 f"a live session to cost at most {FDS_PER_LIVE_SESSION} fds: "
                 f"{len(_daemon_fds(d)) - one_live}")
