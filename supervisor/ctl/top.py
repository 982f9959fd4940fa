"""`sessionctl top`: sessions at a glance, refreshed (curses), or once as JSON.

Runs in the sessionctl process.  Each refresh is one `Top` request: every
visible session's `SessionInfo` plus its worker's cumulative CPU seconds;
CPU % is the difference between two samples over the time between them,
so `--once` takes two samples `--sample-secs` apart.  The table is made by
`render()`, a pure function of the rows and the terminal's size (tested
without a terminal); curses only paints its lines, so the view works over
SSH in 80x24 and degrades to fewer rows, never to wrapped lines.
"""

from __future__ import annotations

import asyncio
import curses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipc import messages as m
from ipc import operator as op
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.render import EXIT_OK, EXIT_USAGE, SORT_KEYS, fmt_age, plural

__all__ = ["Row", "SORT_KEYS", "render", "rows_from", "run_top", "snapshot_json", "totals"]

# Sort key -> (key function, descending).  Letters are the live view's keys.
_KEYS_BY_LETTER = {"c": "cpu", "m": "rss", "t": "turns", "r": "restarts", "a": "age", "i": "id", "s": "state",
                   "b": "budget"}


@dataclass(slots=True)
class Row:
    id: str
    state: str
    handler: str
    pid: int | None
    rss_bytes: int | None
    cpu_secs: float | None
    cpu_percent: float | None
    restarts: int
    turns: int
    last_exit: m.ExitInfo | None
    age_secs: float
    # SessionInfo.budget, and the share of its most used ceiling (None: no ceiling set).
    budget: dict[str, Any]
    budget_percent: float | None
    # SessionInfo.waiting: the permission requests its turn waits on, as dicts.
    waiting: list[dict[str, Any]]

    def as_json(self) -> dict[str, Any]:
        e = self.last_exit
        return {
            "id": self.id, "state": self.state, "handler": self.handler, "pid": self.pid,
            "rss_bytes": self.rss_bytes, "cpu_percent": _round(self.cpu_percent),
            "cpu_secs": _round(self.cpu_secs), "restarts": self.restarts, "turns": self.turns,
            "last_exit": None if e is None else {"reason": e.reason, "code": e.code, "signal": e.signal,
                                                 "at": e.at, "detail": e.detail},
            "age_secs": round(self.age_secs, 1), "waiting": self.waiting,
            # Only where [agent.budget] sets a ceiling: scripts' fields stay as they were.
            **({"budget": self.budget} if self.budget.get("ceilings") else {}),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def rows_from(now: op.TopReply, before: op.TopReply | None) -> list[Row]:
    """Rows of a sample; CPU % against the earlier sample (same worker pid)."""
    earlier: dict[tuple[str, int | None], float] = {}
    if before is not None:
        earlier = {(e.session.id, e.session.pid): e.cpu_secs for e in before.entries
                   if e.cpu_secs is not None}
    span = now.at - before.at if before is not None else 0.0
    rows = []
    for e in now.entries:
        s = e.session
        # Without an earlier sample of this worker (the first refresh): the
        # daemon's own, from its sweep.
        pct: float | None = s.cpu_percent
        prev = earlier.get((s.id, s.pid))
        if e.cpu_secs is not None and prev is not None and span > 0:
            pct = max(0.0, (e.cpu_secs - prev) / span * 100)
        rows.append(Row(
            id=s.id, state=s.state, handler=s.handler, pid=s.pid, rss_bytes=s.rss_bytes,
            cpu_secs=e.cpu_secs, cpu_percent=pct, restarts=s.restarts, turns=s.turns,
            last_exit=s.last_exit, age_secs=max(0.0, now.at - s.created_at) if s.created_at else 0.0,
            budget=s.budget, budget_percent=_budget_percent(s.budget),
            waiting=[{"request_id": w.request_id, "tool": w.tool, "since": w.since, "turn": w.turn, "seq": w.seq}
                     for w in s.waiting],
        ))
    return rows


def _budget_percent(budget: dict[str, Any]) -> float | None:
    shares = [c["used"] / c["limit"] * 100 for c in budget.get("ceilings", ())
              if isinstance(c, dict) and isinstance(c.get("used"), int) and isinstance(c.get("limit"), int)
              and c["limit"] > 0]
    return max(shares) if shares else None


def sort_rows(rows: list[Row], key: str) -> list[Row]:
    if key == "id":
        return sorted(rows, key=lambda r: r.id)
    if key == "state":
        return sorted(rows, key=lambda r: (r.state, r.id))
    keyfns: dict[str, Callable[[Row], tuple[float, float]]] = {
        "cpu": lambda r: (r.cpu_percent or 0.0, r.rss_bytes or 0),
        "rss": lambda r: (r.rss_bytes or 0, r.cpu_percent or 0.0),
        "turns": lambda r: (r.turns, 0),
        "restarts": lambda r: (r.restarts, 0),
        "age": lambda r: (r.age_secs, 0),
        "budget": lambda r: (r.budget_percent or 0.0, 0),
    }
    value = keyfns[key]
    return sorted(rows, key=lambda r: (value(r), r.id), reverse=True)


def totals(rows: list[Row], reply: op.TopReply) -> dict[str, Any]:
    by_state: dict[str, int] = {}
    for r in rows:
        by_state[r.state] = by_state.get(r.state, 0) + 1
    cpu = [r.cpu_percent for r in rows if r.cpu_percent is not None]
    return {
        "sessions": len(rows), "live": sum(1 for r in rows if r.pid is not None), "by_state": by_state,
        "waiting": sum(1 for r in rows if r.waiting),
        "rss_bytes": sum(r.rss_bytes or 0 for r in rows), "cpu_percent": round(sum(cpu), 2) if cpu else None,
        "turns": sum(r.turns for r in rows), "restarts": sum(r.restarts for r in rows),
        "daemon": {"uptime_secs": round(reply.uptime_secs, 1), "rss_bytes": reply.rss_bytes,
                   "clients": reply.clients},
    }


def snapshot_json(rows: list[Row], reply: op.TopReply, sort: str) -> str:
    """`top --once --json`: {"at", "sort", "sessions": [...], "totals": {...}}."""
    return json.dumps({"at": reply.at, "sort": sort, "sessions": [r.as_json() for r in sort_rows(rows, sort)],
                       "totals": totals(rows, reply)})


# ---------------------------------------------------------------- the table


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "K", "M", "G"):
        if value < 1024 or unit == "T":
            break
        value /= 1024
    else:
        unit = "T"
    return f"{value:.0f}{unit}" if unit in ("B", "K") or value >= 100 else f"{value:.1f}{unit}"


_age = fmt_age  # as `ls` shows it


def _exit(e: m.ExitInfo | None) -> str:
    if e is None:
        return "-"
    return e.reason + (f"/{e.signal}" if e.signal else f"/{e.code}" if e.code else "")


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


# (title, width, right-aligned); ID takes what is left of the terminal's width.
_COLUMNS = (("STATE", 11, False), ("PID", 7, True), ("RSS", 6, True), ("CPU%", 5, True),
            ("RST", 3, True), ("TURNS", 5, True), ("LAST EXIT", 16, False), ("AGE", 5, True))
# Shown only when some session has an [agent.budget] ceiling: its most used one, in %.
_BUDGET_COLUMN = ("BUDGET", 6, True)


def render(rows: list[Row], reply: op.TopReply, sort: str, width: int, height: int) -> list[str]:
    """The screen as lines, none longer than `width`, at most `height`."""
    t = totals(rows, reply)
    states = ", ".join(f"{n} {k}" for k, n in sorted(t["by_state"].items())) or "none"
    cpu = "-" if t["cpu_percent"] is None else f"{t['cpu_percent']:.0f}%"
    waiting = f"; {t['waiting']} waiting on a person (sessionctl approve|deny ID)" if t["waiting"] else ""
    head = [
        f"sessiond up {_age(reply.uptime_secs)}, rss {_bytes(reply.rss_bytes)}, {plural(reply.clients, 'client')}",
        f"{plural(t['sessions'], 'session')} ({states}){waiting}",
        f"live {t['live']}: rss {_bytes(t['rss_bytes'])}, cpu {cpu}; turns {t['turns']}, "
        f"restarts {t['restarts']}",
        f"sort: {sort} (c cpu, m rss, t turns, r restarts, a age, i id, s state, b budget; q quit)",
    ]
    with_budget = any(r.budget_percent is not None for r in rows)
    columns = (*_COLUMNS, _BUDGET_COLUMN) if with_budget else _COLUMNS
    fixed = sum(w + 1 for _, w, _ in columns)
    id_width = max(6, min(24, width - fixed))

    def line(cells: list[str]) -> str:
        out = _clip(cells[0], id_width).ljust(id_width)
        for (_, w, right), cell in zip(columns, cells[1:]):
            cell = _clip(cell, w)
            out += " " + (cell.rjust(w) if right else cell.ljust(w))
        return out.rstrip()

    table = [line(["ID", *(title for title, _, _ in columns)])]
    for r in sort_rows(rows, sort):
        pct = "-" if r.cpu_percent is None else f"{r.cpu_percent:.0f}"
        budget = "-" if r.budget_percent is None else f"{r.budget_percent:.0f}%"
        # A turn that waits on a person: "waiting" where "running" was (JSON keeps the state).
        state = "waiting" if r.waiting else r.state
        table.append(line([r.id, state, str(r.pid or "-"), _bytes(r.rss_bytes), pct, str(r.restarts),
                           str(r.turns), _exit(r.last_exit), _age(r.age_secs), budget]))
    lines = [_clip(x, width) for x in head + [""] + table]
    if len(lines) > height:
        hidden = len(lines) - height + 1
        lines = lines[: height - 1] + [_clip(f"... {hidden} more (a taller terminal shows them)", width)]
    return lines


# ---------------------------------------------------------------- running


async def run_top(client: AsyncClient, *, once: bool, as_json: bool, sort: str, interval: float,
                  sample_secs: float) -> int:
    if once:
        first = await client.top()
        await asyncio.sleep(sample_secs)
        second = await client.top()
        rows = rows_from(second, first)
        if as_json:
            print(snapshot_json(rows, second, sort))
        else:
            print("\n".join(render(rows, second, sort, 80, 10_000)))
        return EXIT_OK
    if as_json:
        return await _json_lines(client, sort, interval)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("sessionctl: top needs a terminal; `top --once` prints one sample, "
              "`--json top` one JSON line per refresh", file=sys.stderr)
        return EXIT_USAGE
    return await _live(client, sort, interval)


async def _json_lines(client: AsyncClient, sort: str, interval: float) -> int:
    """`--json top` without --once: a stream, so JSON lines, one a refresh."""
    before = await client.top()
    while True:
        await asyncio.sleep(interval)
        reply = await client.top()
        print(snapshot_json(rows_from(reply, before), reply, sort), flush=True)
        before = reply


async def _live(client: AsyncClient, sort: str, interval: float) -> int:
    screen = curses.initscr()
    try:
        curses.noecho()
        curses.cbreak()
        screen.keypad(True)
        screen.nodelay(True)
        with _suppress_curses_error():
            curses.curs_set(0)
        before: op.TopReply | None = None
        while True:
            reply = await client.top()
            rows = rows_from(reply, before)
            before = reply
            height, width = screen.getmaxyx()
            screen.erase()
            for y, text in enumerate(render(rows, reply, sort, width - 1, height)):
                with _suppress_curses_error():
                    screen.addstr(y, 0, text)
            screen.refresh()
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                key = screen.getch()
                if key in (ord("q"), 27):
                    return EXIT_OK
                if 0 <= key < 256 and chr(key) in _KEYS_BY_LETTER:
                    sort = _KEYS_BY_LETTER[chr(key)]
                    break
                if key == curses.KEY_RESIZE or key == ord(" "):
                    break
                await asyncio.sleep(0.05)
    finally:
        curses.nocbreak()
        screen.keypad(False)
        curses.echo()
        curses.endwin()


class _suppress_curses_error:
    """Writing the bottom-right cell raises curses.error; the text is there."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return kind is curses.error
