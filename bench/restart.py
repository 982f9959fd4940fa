"""SIGKILL a worker -> its session idle again, with a short and a long history.

    .venv/bin/python bench/restart.py [--n 50] [--history 10000] [--json]

Four sessions in one daemon: the `echo` handler (its state is a turn
counter) and `bench.bench_handlers:grow` (keeps every input in a list; its
snapshot is the list, so what a new worker restores grows with the
history), each with a history of 10 and of `--history` turns (one message of
`--msg-bytes` each), built by sending real turns through the daemon (the two
long ones concurrently).  With `snapshot_every_turns` = 64 (the default) the
state on disk is one snapshot plus a log tail of < 64 records, whatever the
history; its size is shown.

Each trial: read the worker's pid (`status`), SIGKILL it from here, and wait
on an `attach` stream for `StateChanged{new="idle"}`; timed from just before
the kill to that event's arrival.  The intermediate states split it:
`crashed` (zygote reaped it, daemon told), `starting` (after the restart
backoff), `idle` (snapshot + tail read, fork, Boot sent, handler restored,
Ready).  Trials go round-robin over the four sessions; `--warmup` rounds
are not timed.  At the end one more turn on each session checks that the
restored worker has the whole history (the reply's `N:` prefix).

Restart policy used, so that backoff does not dominate: `[agent.worker]
restart_backoff_initial_ms = 1`, `restart_backoff_max_ms = 1` (every
restart waits 1 ms), `max_restart_attempts = 1000000` within
`restart_window_secs = 1`.

Goals: kill -> idle median <= 20 ms in every case; the long history within
3x of the short one, per handler.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

from bench import _common as c

from ipc import messages as m
from supervisor.ctl.client import AsyncClient

BACKOFF_MS = 1
CONFIG = f"""
[agent.limits]
max_concurrent_sessions = 100

[agent.worker]
max_restart_attempts = 1000000
restart_window_secs = 1.0
restart_backoff_initial_ms = {BACKOFF_MS}
restart_backoff_max_ms = {BACKOFF_MS}
"""

HANDLERS = {"echo": "echo", "grow": "bench.bench_handlers:grow"}


async def watch(client: AsyncClient, sid: str, q: asyncio.Queue[tuple[int, m.Event]]) -> None:
    async for ev in client.attach(sid):
        q.put_nowait((time.perf_counter_ns(), ev))


async def one_restart(client: AsyncClient, sid: str, q: asyncio.Queue[tuple[int, m.Event]]) -> dict[str, int]:
    pid = (await client.status(sid)).pid
    assert pid, f"session {sid} has no worker"
    while not q.empty():
        q.get_nowait()
    marks: dict[str, int] = {}
    t0 = time.perf_counter_ns()
    os.kill(pid, signal.SIGKILL)
    while True:
        t, ev = await asyncio.wait_for(q.get(), 10.0)
        if isinstance(ev, m.StateChanged):
            marks.setdefault(ev.new, t - t0)
            if ev.new == "idle":
                return marks
            if ev.new == "failed":
                raise RuntimeError(f"session {sid} failed instead of restarting")


def disk_size(state_dir: Path, sid: str) -> tuple[int, int]:
    d = state_dir / "sessions" / sid
    snap = (d / "snapshot").stat().st_size if (d / "snapshot").exists() else 0
    logs = sum(p.stat().st_size for p in d.glob("log.*"))
    return snap, logs


def main() -> int:
    args, rep = c.history_bench("restart", __doc__, n=(50, "timed restarts per case"), warmup=3)
    cases = c.history_cases(HANDLERS, args)
    daemon = c.BenchDaemon(CONFIG, tag="sdb-rst").start()
    samples: dict[tuple[str, int], list[dict[str, int]]] = {k: [] for k in cases}
    sids: dict[tuple[str, int], str] = {}
    sizes: dict[tuple[str, int], tuple[int, int]] = {}
    checks: dict[tuple[str, int], str] = {}
    build_s = 0.0

    async def run() -> None:
        nonlocal build_s
        client = await AsyncClient.connect(daemon.socket, client_name="bench-restart")
        watchers: list[asyncio.Task[None]] = []
        try:
            for case in cases:
                sids[case] = (await client.create(handler=HANDLERS[case[0]])).id
            t = time.monotonic()
            await asyncio.gather(*(c.build_history(client, sids[k], k[1], args.msg_bytes) for k in cases))
            build_s = time.monotonic() - t
            for k in cases:
                sizes[k] = disk_size(daemon.state_dir, sids[k])
            queues = {k: asyncio.Queue() for k in cases}  # type: ignore[var-annotated]
            watchers = [asyncio.create_task(watch(client, sids[k], queues[k])) for k in cases]
            await asyncio.sleep(0.1)
            c.quiet_gc()
            for r in range(args.warmup + args.n):
                for k in cases:
                    marks = await one_restart(client, sids[k], queues[k])
                    if r >= args.warmup:
                        samples[k].append(marks)
                daemon.remember()
            for k in cases:
                reply = await client.send_text(sids[k], "check")
                want = f"{k[1] + 1}: "
                checks[k] = "ok" if reply.startswith(want) else f"BAD: {reply[:20]!r}, wanted {want!r}"
        finally:
            for w in watchers:
                w.cancel()
            for w in watchers:
                with contextlib.suppress(BaseException):
                    await w
            await client.close()

    try:
        asyncio.run(run())
    finally:
        daemon.cleanup()

    def stat(k: tuple[str, int], key: str) -> dict[str, float]:
        return c.summarize([s[key] for s in samples[k] if key in s])

    rows = []
    figs: dict[str, Any] = {}
    for k in cases:
        idle = stat(k, "idle")
        crashed = stat(k, "crashed")
        starting = stat(k, "starting")
        split = [
            c.summarize([s["crashed"] for s in samples[k]])["median_us"],
            c.summarize([s["starting"] - s["crashed"] for s in samples[k]])["median_us"],
            c.summarize([s["idle"] - s["starting"] for s in samples[k]])["median_us"],
        ]
        snap, logs = sizes[k]
        figs[f"{k[0]}_{k[1]}"] = {"idle": idle, "crashed": crashed, "starting": starting,
                                  "kill_to_crashed_med_us": split[0], "backoff_med_us": split[1],
                                  "boot_med_us": split[2], "snapshot_bytes": snap, "log_bytes": logs,
                                  "restored": checks[k]}
        rows.append([f"{k[0]}, {k[1]:,} turns", str(int(idle["n"])), c.fmt_us(idle["median_us"]),
                     c.fmt_us(idle["p99_us"]), c.fmt_us(idle["min_us"]),
                     c.fmt_us(split[0]), c.fmt_us(split[1]), c.fmt_us(split[2]),
                     f"{snap / 1024:.0f} KiB + {logs / 1024:.1f} KiB", checks[k]])
    rep.figures = {"cases": figs, "backoff_ms": BACKOFF_MS, "msg_bytes": args.msg_bytes,
                   "build_s": build_s}
    rep.say(f"restart: SIGKILL -> idle again, {args.n} per case, backoff {BACKOFF_MS} ms "
            f"(initial = max), histories built in {build_s:.1f} s")
    rep.table(["session", "n", "median", "p99", "min", "->crashed", "->starting", "->idle",
               "on disk (snap + log)", "restored"], rows)
    rep.say("  ->crashed: kill to the exit noticed; ->starting: backoff; ->idle: read state, fork, boot, "
            "restore, Ready (medians of each step)")

    worst = max(figs[f"{k[0]}_{k[1]}"]["idle"]["median_us"] for k in cases)
    rep.goal("SIGKILL -> idle median <= 20 ms (worst case)", worst, 20_000, c.fmt_us(worst))
    c.history_goals(rep, args, HANDLERS, lambda case: figs[case]["idle"]["median_us"], 3.0,
                    "{history:,} turns within 3x of {short}")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
