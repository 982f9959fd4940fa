"""Idle sessions are watched more cheaply, not less surely.

A worker with no turn running beats IDLE_HEARTBEAT_FACTOR times more
slowly, and a session with no turn and no process of its own has its memory
read every QUIET_EVERY-th sweep (supervisor.core.sweep).  A stuck loop or a
background allocation between turns is still caught, only later.
"""

from __future__ import annotations

import time

import pytest

from harness import FAST_SWEEP, wait_for
from ipc.contract import IDLE_HEARTBEAT_FACTOR
from supervisor.core.sweep import QUIET_EVERY

pytestmark = pytest.mark.process


def test_a_loop_stuck_between_turns_is_still_killed(make_daemon) -> None:
    d = make_daemon(FAST_SWEEP)
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:after_turn",
                       settings={"agent.worker.heartbeat_interval_secs": 0.05}).id
        assert c.send_text(sid, "freeze") == "ok"
        # 3 missed beats at 0.05 s x the idle factor; polled with room.
        wait_for(lambda: (s := c.status(sid)).last_exit is not None, 3 * 0.05 * IDLE_HEARTBEAT_FACTOR + 10,
                 "the frozen idle worker to be killed")
        assert c.status(sid).last_exit.reason == "killed_heartbeat"


def test_memory_grown_between_turns_is_still_capped(make_daemon) -> None:
    d = make_daemon(FAST_SWEEP)
    with d.client() as c:
        sid = c.create(handler="fixture_handlers:after_turn", settings={"agent.limits.max_memory_mb": 64}).id
        assert c.send_text(sid, "grow 200") == "ok"
        wait_for(lambda: (s := c.status(sid)).last_exit is not None, 0.05 * QUIET_EVERY + 10,
                 "the idle worker that grew to be killed")
        assert c.status(sid).last_exit.reason == "killed_memory"


def test_an_idle_session_keeps_its_worker(make_daemon) -> None:
    """The slower idle beat is not mistaken for a stuck loop."""
    d = make_daemon(FAST_SWEEP)
    with d.client() as c:
        sid = c.create(handler="echo").id
        pid = c.status(sid).pid
        assert c.send_text(sid, "one") == "1: one"
        # Longer than 3 beats at the full pace, well within the idle allowance.
        ping_until = time.monotonic() + 3 * 0.2 * 2
        while time.monotonic() < ping_until:
            assert c.ping(sid).pid == pid
        assert c.send_text(sid, "two") == "2: two"
        assert c.status(sid).pid == pid and c.status(sid).last_exit is None
