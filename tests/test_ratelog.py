"""Rate-limited warnings (pure, with a stand-in clock) and, against a real
daemon, a flood of oversized frames from one peer that leaves a handful of
log lines instead of one each."""

from __future__ import annotations

import logging
import struct

import pytest

from harness import Daemon, raw_connect
from supervisor.api import ratelog
from supervisor.api.ratelog import RateLimitedLog


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.pure
def test_a_burst_per_key_then_a_count_of_what_was_held_back(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    monkeypatch.setattr(ratelog.time, "monotonic", clock.monotonic)
    limited = RateLimitedLog(logging.getLogger("t.ratelog"), burst=3, window_secs=60)
    with caplog.at_level(logging.WARNING, logger="t.ratelog"):
        for i in range(10):
            limited.warning(1000, "bad frame %d", i)
        limited.warning(2000, "another peer")  # its own budget
        assert [r.getMessage() for r in caplog.records] == [
            "bad frame 0", "bad frame 1", "bad frame 2", "another peer"]
        caplog.clear()
        clock.now += 61
        limited.warning(1000, "bad frame %d", 10)
        assert [r.getMessage() for r in caplog.records] == [
            "bad frame 10 (7 similar line(s) held back in the last 60s)"]


@pytest.mark.pure
def test_the_key_table_stays_bounded() -> None:
    limited = RateLimitedLog(logging.getLogger("t.ratelog2"), burst=1, max_keys=8)
    for key in range(100):
        limited.warning(key, "x")
    assert len(limited._seen) <= 8


@pytest.mark.process
def test_a_peer_flooding_oversized_frames_makes_a_few_lines(daemon: Daemon) -> None:
    for _ in range(40):
        with raw_connect(daemon.socket) as s:
            s.sendall(struct.pack(">I", 1 << 31))
            s.recv(4096)
    lines = [line for line in daemon.log.splitlines() if "sent a frame of" in line]
    assert 1 <= len(lines) <= 10, lines
