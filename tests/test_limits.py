"""The memory sweep's reader and verdicts, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from harness import wait_for
from supervisor.limits import MIB, ProcTable, SessionMemory, memory_verdict


def test_rss_of_a_tree_counts_children() -> None:
    hog = subprocess.Popen([sys.executable, "-c",
                            "b = bytearray(64 << 20)\n"
                            "for i in range(0, len(b), 4096): b[i] = 1\n"
                            "print('ready', flush=True)\nimport signal; signal.pause()"],
                           stdout=subprocess.PIPE)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == b"ready\n"
        table = ProcTable()
        mem = SessionMemory()
        total = mem.measure(table, os.getpid())
        assert hog.pid in mem.pids
        mine = psutil.Process().memory_info().rss
        assert total >= mine + 60 * MIB
        # Once seen, a descendant stays counted even if it is no longer a child
        # (re-parented escapees are tracked by pid).
        other = SessionMemory(pids={hog.pid})
        assert other.measure(table, os.getpid()) >= total - 8 * MIB
    finally:
        hog.kill()
        hog.wait()


def test_childless_process_keeps_its_files_open_between_sweeps(monkeypatch) -> None:
    import supervisor.limits as limits

    opened: list[str] = []
    real_open = os.open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(limits.os, "open", counting_open)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        table = ProcTable()
        mem = SessionMemory()
        assert mem.measure(table, sleeper.pid) > 0
        first_opens = len(opened)
        for _ in range(5):
            assert mem.measure(table, sleeper.pid) > 0
        assert len(opened) == first_opens  # pread on kept-open files, no reopen per sweep
    finally:
        sleeper.kill()
        sleeper.wait()
    wait_for(lambda: table.rss(sleeper.pid) is None, 5, "the reader to notice the exit")
    assert sleeper.pid not in table._statm
    table.close()


def test_verdicts() -> None:
    assert memory_verdict(100 * MIB, 64, None, False).kill
    assert not memory_verdict(64 * MIB, 64, None, False).kill  # at the cap is allowed
    v = memory_verdict(50 * MIB, 64, 40, False)
    assert v.high_crossed and not v.kill
    assert memory_verdict(50 * MIB, 64, 40, True) == memory_verdict(10 * MIB, 64, None, False)
    assert memory_verdict(30 * MIB, 64, 40, True).high_cleared
    assert memory_verdict(30 * MIB, 64, None, True).high_cleared


# ---------------------------------------------------------------- the sweep's other verdicts


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
    from supervisor.limits import HEARTBEATS_MISSED, heartbeat_overdue

    assert HEARTBEATS_MISSED == 3
    assert heartbeat_overdue(1000.0 + silent, 1000.0, interval, booted) is overdue


@pytest.mark.parametrize("idle_for, idle, busy, expired", [
    (10.0, True, False, False),
    (30.01, True, False, True),
    (30.01, False, False, False),  # running a turn, stopped, starting...
    (30.01, True, True, False),    # its lock is held: something else is under way
    (30.0, True, False, False),
])
def test_idle_expired(idle_for: float, idle: bool, busy: bool, expired: bool) -> None:
    from supervisor.limits import idle_expired

    assert idle_expired(500.0 + idle_for, 500.0, 30.0, idle, busy) is expired


@pytest.mark.parametrize("elapsed, timeout, left", [
    (0.0, 10.0, 10.0), (4.0, 10.0, 6.0), (10.0, 10.0, 0.0), (25.0, 10.0, 0.0),
])
def test_turn_deadline_counts_from_the_turns_start(elapsed: float, timeout: float, left: float) -> None:
    from supervisor.limits import turn_deadline_left

    assert turn_deadline_left(100.0 + elapsed, 100.0, timeout) == pytest.approx(left)
