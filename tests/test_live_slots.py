"""Fair shares of live slots: one user whose sessions all sleep in turns
holds at most [daemon] max_live_sessions_per_uid of them, and another
user's create and send still work (issue 21)."""

from __future__ import annotations

import os

import pytest

from harness import Daemon, run_as
from supervisor.ctl.client import Client, RequestError

NOBODY = 65534
OTHER = 65533
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")

CONFIG = f"""
[agent.limits]
max_concurrent_sessions = 4
[daemon]
socket_mode = "0666"
allowed_uids = [{NOBODY}, {OTHER}]
stop_grace_secs = 1.0
"""


def _hold_sleeping_turns(path: str, count: int) -> dict[str, object]:
    """As the calling user: `count` sessions, each left in a long turn,
    then one more create and, in a new idle session, nothing."""
    out: dict[str, object] = {"made": []}
    with Client(path) as c:
        for i in range(count):
            sid = c.create(session=f"hog{i}", handler="fixture_handlers:slow").id
            events = c.send(sid, "3000")  # 60 s of ticks
            next(events)  # the turn runs; we leave it running
            out["made"].append(sid)  # type: ignore[attr-defined]
    with Client(path) as c:
        try:
            c.create(session="one-more", handler="fixture_handlers:slow")
            out["more"] = "created"
        except RequestError as exc:
            out["more"] = [exc.code, str(exc)]
    return out


def _create_and_send(path: str) -> str:
    with Client(path) as c:
        sid = c.create(session="b-session", handler="echo").id
        return c.send_text(sid, "hello")


@pytest.mark.process
@root_only
def test_one_user_cannot_hold_every_live_slot(make_daemon) -> None:
    d: Daemon = make_daemon(CONFIG)
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)
    # The default ceiling is half of max_concurrent_sessions: 2 of 4.
    a = run_as(NOBODY, lambda: _hold_sleeping_turns(path, 2))
    assert a["made"] == ["hog0", "hog1"]
    code, message = a["more"]
    assert code == "capacity" and "max_live_sessions_per_uid" in message and f"uid {NOBODY}" in message
    # The other user is not affected: a create and a turn.
    assert "hello" in run_as(OTHER, lambda: _create_and_send(path))
    with d.client() as c:
        states = {s.id: s.state for s in c.list()}
        assert states["hog0"] == states["hog1"] == "running"
        assert "one-more" not in states


@pytest.mark.process
@root_only
def test_at_its_ceiling_a_user_hibernates_its_own_idle_session(make_daemon) -> None:
    d: Daemon = make_daemon(CONFIG + "max_live_sessions_per_uid = 1\n")
    os.chmod(d.sockdir, 0o755)
    path = str(d.socket)

    def two_idle() -> list[str]:
        with Client(path) as c:
            c.create(session="first", handler="echo")
            c.send_text("first", "x")
            c.create(session="second", handler="echo")
            return [c.status("first").state, c.status("second").state]

    assert run_as(NOBODY, two_idle) == ["hibernated", "idle"]
    assert "hello" in run_as(OTHER, lambda: _create_and_send(path))
    with d.client() as c:  # the other user's session did not push NOBODY's out
        assert c.status("second").state == "idle"
