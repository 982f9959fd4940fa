"""The memory sweep's reader and verdicts, against real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from harness import wait_for
from supervisor.core.limits import MIB, SessionMemory, memory_verdict
from supervisor.host.proctable import ProcTable


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


@pytest.mark.process
def test_childless_process_keeps_its_files_open_between_sweeps(monkeypatch) -> None:
    import supervisor.host.proctable as limits

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


@pytest.mark.pure
def test_verdicts() -> None:
    assert memory_verdict(100 * MIB, 64, None, False).kill
    assert not memory_verdict(64 * MIB, 64, None, False).kill  # at the cap is allowed
    v = memory_verdict(50 * MIB, 64, 40, False)
    assert v.high_crossed and not v.kill
    assert memory_verdict(50 * MIB, 64, 40, True) == memory_verdict(10 * MIB, 64, None, False)
    assert memory_verdict(30 * MIB, 64, 40, True).high_cleared
    assert memory_verdict(30 * MIB, 64, None, True).high_cleared

