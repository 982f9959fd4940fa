"""The memory sweep's reader and verdicts, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from harness import wait_for
from supervisor.core.limits import MIB, SessionMemory, memory_verdict
from supervisor.host.proctable import ProcTable
from supervisor.spawn.pidfd import PidFd


@pytest.mark.process
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


def _my_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.process
def test_a_measure_holds_no_proc_file_after_it_returns() -> None:
    """Issue 32: the table opens a process's /proc files for one measure
    (or CPU sample) and closes them before it returns; the old table kept
    three per process for as long as the process lived."""
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60 & wait"])
    mem = SessionMemory()
    kids: list[psutil.Process] = []
    try:
        kids = wait_for(lambda: len(psutil.Process(parent.pid).children()) == 2
                        and psutil.Process(parent.pid).children(), 10, "two children")
        table = ProcTable()
        held = _my_fds()
        for _ in range(3):
            assert mem.measure(table, parent.pid) > 0
            mem.sample_cpu(table, time.monotonic())
            assert _my_fds() == held + 2  # the children's pidfds, nothing else
            assert table.held() == 0
        assert len(mem.pids) == 2 and len(mem.pidfds) == 2
        assert mem.cpu_ticks is not None
    finally:
        for kid in kids:
            kid.kill()
        parent.kill()
        parent.wait()
        mem.close()


@pytest.mark.process
def test_a_tracked_pid_is_read_only_as_the_process_its_pidfd_names() -> None:
    """A descendant tracked from an earlier pass is read through the
    pidfd taken when it was first seen: once that process is reaped, its
    number (here another, unrelated process's: what a reuse looks like)
    is neither counted nor given a handle.  The old table, whose statm fd
    stood for the process, read a number it had no file of by number."""
    gone = subprocess.Popen(["sleep", "60"])
    stale = PidFd(os.pidfd_open(gone.pid), gone.pid)
    gone.kill()
    gone.wait()  # reaped: the handle names no process now
    stranger = subprocess.Popen(["sleep", "60"])
    worker = subprocess.Popen(["sleep", "60"])
    try:
        table = ProcTable()
        mem = SessionMemory(pids={stranger.pid}, pidfds={stranger.pid: stale})
        own = mem.measure(table, worker.pid)
        assert stranger.pid not in mem.rss_by_pid and stranger.pid not in mem.pidfds
        assert own == mem.rss_by_pid[worker.pid]
        assert stale.fd < 0  # the stale handle was let go of
    finally:
        for p in (stranger, worker):
            p.kill()
            p.wait()


@pytest.mark.process
def test_a_worker_is_read_only_while_its_start_time_matches() -> None:
    """The worker's number is checked by its start time (read after its
    other files): another process under that number is no worker of the
    session's, neither its memory nor its children."""
    parent = subprocess.Popen(["bash", "-c", "sleep 60 & wait"])
    kids: list[psutil.Process] = []
    try:
        kids = wait_for(lambda: psutil.Process(parent.pid).children(), 10, "a child")
        table = ProcTable()
        mem = SessionMemory()
        assert mem.measure(table, parent.pid) > 0 and mem.worker_start
        other = SessionMemory(worker_start=mem.worker_start + 1)  # as if another started under the number
        assert other.measure(table, parent.pid) == 0
        assert not other.pids and not other.pidfds and not other.rss_by_pid
        mem.close()
    finally:
        for kid in kids:
            kid.kill()
        parent.kill()
        parent.wait()


@pytest.mark.pure
def test_verdicts() -> None:
    assert memory_verdict(100 * MIB, 64, None, False).kill
    assert not memory_verdict(64 * MIB, 64, None, False).kill  # at the cap is allowed
    v = memory_verdict(50 * MIB, 64, 40, False)
    assert v.high_crossed and not v.kill
    assert memory_verdict(50 * MIB, 64, 40, True) == memory_verdict(10 * MIB, 64, None, False)
    assert memory_verdict(30 * MIB, 64, 40, True).high_cleared
    assert memory_verdict(30 * MIB, 64, None, True).high_cleared

