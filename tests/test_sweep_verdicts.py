"""The sweep's verdicts (pure): when a heartbeat is overdue, how much of a
silence is a starved worker's own, when an idle
session hibernates, how much of a turn's timeout is left.  The memory
verdict and the /proc reader are in test_limits.py."""

from __future__ import annotations

import pytest

from supervisor.core.limits import HEARTBEATS_MISSED, heartbeat_overdue, idle_expired, own_silence, turn_deadline_left

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("silent, interval, booted, overdue", [
    (0.0, 1.0, True, False),
    (2.99, 1.0, True, False),
    (3.0, 1.0, True, False),     # exactly three intervals: not yet
    (3.01, 1.0, True, True),
    (100.0, 1.0, False, False),  # not booted: boot_timeout_secs governs it
    (0.61, 0.2, True, True),
    (0.59, 0.2, True, False),
])
def test_heartbeat_overdue_after_three_missed_intervals(
    silent: float, interval: float, booted: bool, overdue: bool
) -> None:
    assert HEARTBEATS_MISSED == 3
    assert heartbeat_overdue(1000.0 + silent, 1000.0, interval, booted) is overdue


@pytest.mark.parametrize("silent, waiting, own", [
    (2.0, None, 2.0),   # the kernel does not say: all of it
    (2.0, 0.0, 2.0),    # running or asleep: stuck
    (2.0, 0.49, 2.0),   # mostly not waiting: stuck
    (2.0, 0.5, 1.0),    # starved: the half it could run
    (2.0, 0.75, 0.5),
    (2.0, 0.95, 0.2),   # never less than a tenth...
    (2.0, 1.0, 0.2),
    (30.0, 1.0, 3.0),   # ...so ten allowances of silence are one, however starved
])
def test_a_starved_worker_s_silence_counts_the_share_it_could_run(
        silent: float, waiting: float | None, own: float) -> None:
    assert own_silence(silent, waiting) == pytest.approx(own)


@pytest.mark.parametrize("idle_for, idle, busy, expired", [
    (10.0, True, False, False),
    (30.01, True, False, True),
    (30.01, False, False, False),  # running a turn, stopped, starting...
    (30.01, True, True, False),    # its lock is held: something else is under way
    (30.0, True, False, False),
])
def test_idle_expired(idle_for: float, idle: bool, busy: bool, expired: bool) -> None:
    assert idle_expired(500.0 + idle_for, 500.0, 30.0, idle, busy) is expired


@pytest.mark.parametrize("elapsed, timeout, left", [
    (0.0, 10.0, 10.0), (4.0, 10.0, 6.0), (10.0, 10.0, 0.0), (25.0, 10.0, 0.0),
])
def test_turn_deadline_counts_from_the_turns_start(elapsed: float, timeout: float, left: float) -> None:
    assert turn_deadline_left(100.0 + elapsed, 100.0, timeout) == pytest.approx(left)
