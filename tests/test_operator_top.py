"""`sessionctl top`: the table fits a terminal whatever the sessions, CPU %
comes from two samples, and `top --once --json` has the fields scripts use."""

from __future__ import annotations

import json

import pytest

from ipc import messages as m
from ipc import operator as op
from supervisor.ctl.top import SORT_KEYS, render, rows_from, sort_rows


def reply(at: float, *entries: tuple[str, str, int | None, float | None], created: float = 1000.0) -> op.TopReply:
    return op.TopReply(id=1, at=at, uptime_secs=3725, rss_bytes=40 << 20, clients=2, entries=[
        op.TopEntry(session=m.SessionInfo(
            id=sid, state=state, handler="echo", pid=pid, rss_bytes=(pid or 0) << 10, turns=7, restarts=1,
            created_at=created, last_exit=m.ExitInfo(reason="killed_memory", signal=9, at=at - 5)),
            cpu_secs=cpu)
        for sid, state, pid, cpu in entries
    ])


@pytest.mark.pure
def test_cpu_percent_is_the_difference_of_two_samples_of_the_same_worker() -> None:
    before = reply(100.0, ("a", "running", 11, 1.0), ("b", "idle", 12, 5.0), ("c", "idle", 13, 2.0))
    now = reply(102.0, ("a", "running", 11, 2.0), ("b", "idle", 99, 0.5), ("c", "hibernated", None, None),
                ("d", "idle", 14, 0.1))
    rows = {r.id: r for r in rows_from(now, before)}
    assert rows["a"].cpu_percent == pytest.approx(50.0)
    assert rows["b"].cpu_percent is None  # a new worker (another pid): no earlier sample
    assert rows["c"].cpu_percent is None and rows["d"].cpu_percent is None
    assert rows["a"].age_secs == 0.0  # created "after" the sample (clocks): never negative
    assert [r.id for r in rows_from(now, None)] == ["a", "b", "c", "d"]


@pytest.mark.pure
def test_the_table_fits_80x24_with_many_sessions_and_long_ids() -> None:
    entries = [(f"session-with-a-very-long-name-{i:03d}" + "x" * 30, "interrupting", 4_000_000 + i, float(i))
               for i in range(200)]
    now = reply(2000.0, *entries, created=0.0)
    rows = rows_from(now, reply(1999.0, *[(e[0], e[1], e[2], 0.0) for e in entries]))
    for key in SORT_KEYS:
        lines = render(rows, now, key, 80, 24)
        assert len(lines) == 24
        assert all(len(line) <= 80 for line in lines), key
        assert "more" in lines[-1]
    lines = render(rows, now, "cpu", 80, 24)
    assert lines[0].startswith("sessiond up 1h02m") and "200 sessions" in lines[1]
    header = next(line for line in lines if line.startswith("ID"))
    for title in ("STATE", "PID", "RSS", "CPU%", "RST", "TURNS", "LAST EXIT", "AGE"):
        assert title in header
    # The busiest first; a tiny terminal still gets whole lines.
    assert sort_rows(rows, "cpu")[0].id == entries[-1][0]
    assert all(len(line) <= 30 for line in render(rows, now, "rss", 30, 5))
    assert len(render(rows, now, "rss", 30, 5)) == 5
