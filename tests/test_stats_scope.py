"""`stats` is scoped to the asker: a non-admin sees counts of its own
sessions and connections only; admins see the daemon's (issue 21)."""

from __future__ import annotations

import os

import pytest

from harness import Daemon, run_as
from supervisor.ctl.client import Client

pytestmark = pytest.mark.process

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


@root_only
def test_stats_counts_only_the_askers_own_sessions(make_daemon) -> None:
    d: Daemon = make_daemon(f'[daemon]\nsocket_mode = "0666"\nallowed_uids = [{NOBODY}]\n')
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)
    with d.client() as c:
        for i in range(3):
            c.create(session=f"root{i}", handler="echo")
        c.stop("root2")

    def mine() -> list[object]:
        with Client(path) as c:
            c.create(session="nobodys", handler="echo")
            s = c.stats()
            return [s.sessions, s.by_state, s.live_workers, s.clients, s.pid, s.version]

    sessions, by_state, live, clients, pid, version = run_as(NOBODY, mine)
    assert (sessions, by_state, live, clients) == (1, {"idle": 1}, 1, 1)
    assert pid == d.pid and version  # what the daemon is stays visible
    with d.client() as c:  # root is an admin: the daemon's figures
        s = c.stats()
        assert s.sessions == 4 and s.by_state == {"idle": 3, "stopped": 1} and s.live_workers == 3
        assert s.clients == 1
        top = c.top()
        assert {e.session.id for e in top.entries} == {"root0", "root1", "root2", "nobodys"}
