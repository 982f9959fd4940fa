"""Committing one turn: does it cost more with a long history?

    .venv/bin/python bench/persist.py [--n 500] [--history 10000] [--json]

Four sessions in one daemon: `echo` (state: a turn counter) and
`bench.bench_handlers:grow` (keeps every input in a list; its snapshot is
that list), each with 10 and `--history` prior turns of `--msg-bytes`
each, built by sending real turns (the long ones concurrently).  Then `--n`
timed turns on each, round-robin over the four sessions so that machine
noise falls on all of them alike: `AsyncClient.send_text` -> reply, i.e.
input appended + fdatasync, `Accepted`, the worker's turn, its record
appended + fdatasync, `TurnDone`.  Every `snapshot_every_turns` (64) turns
the worker also sends its whole state and the daemon writes a snapshot
(temp file, fsync, rename, fsync of the directory) and starts a new log:
for `grow` with a long history that is the one step whose cost grows with
the history, so it shows in the mean and the p99, not in the median.

Floor: a loop of `os.write` (one ~100-byte record) + `os.fdatasync` on a
temp file in the daemon's state directory (same file system), one sample
after each round, i.e. interleaved with the turns.  A turn makes two of
those (input, commit).

Goal: the long history's median turn within 2x of the short one's, per
handler.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys

import asyncio
import os
import time
from typing import Any

from bench import _common as c

from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent.limits]
max_concurrent_sessions = 100
"""

HANDLERS = {"echo": "echo", "grow": "bench.bench_handlers:grow"}
SNAPSHOT_EVERY = 64  # [agent.worker] snapshot_every_turns, the default


def fsync_sample(fd: int, record: bytes) -> int:
    t0 = time.perf_counter_ns()
    os.write(fd, record)
    os.fdatasync(fd)
    return time.perf_counter_ns() - t0


def main() -> int:
    args, rep = c.history_bench("persist", __doc__, n=(500, "timed turns per session"), warmup=20)
    cases = c.history_cases(HANDLERS, args)
    daemon = c.BenchDaemon(CONFIG, tag="sdb-per").start()
    samples: dict[tuple[str, int], list[int]] = {k: [] for k in cases}
    floor: list[int] = []
    build_s = 0.0

    async def run() -> None:
        nonlocal build_s
        client = await AsyncClient.connect(daemon.socket, client_name="bench-persist")
        path = daemon.state_dir / "fsync-floor.tmp"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        record = b"\0" * 112
        try:
            sids = {k: (await client.create(handler=HANDLERS[k[0]])).id for k in cases}
            t = time.monotonic()
            await asyncio.gather(*(c.build_history(client, sids[k], k[1], args.msg_bytes) for k in cases))
            build_s = time.monotonic() - t
            c.quiet_gc()
            for r in range(args.warmup + args.n):
                for k in cases:
                    text = c.message(k[1] + r, args.msg_bytes)
                    t0 = time.perf_counter_ns()
                    await client.send_text(sids[k], text)
                    dt = time.perf_counter_ns() - t0
                    if r >= args.warmup:
                        samples[k].append(dt)
                dt = fsync_sample(fd, record)
                if r >= args.warmup:
                    floor.append(dt)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
            await client.close()

    try:
        asyncio.run(run())
    finally:
        daemon.cleanup()

    s_floor = c.summarize(floor)
    figs: dict[str, Any] = {"floor_append_fdatasync": s_floor}
    rows = []
    for k in cases:
        s = c.summarize(samples[k])
        figs[f"{k[0]}_{k[1]}"] = s
        rows.append([f"{k[0]}, {k[1]:,} prior turns", str(int(s["n"])), c.fmt_us(s["median_us"]),
                     c.fmt_us(s["mean_us"]), c.fmt_us(s["p99_us"]), c.fmt_us(s["min_us"]),
                     f"{s['median_us'] / s_floor['median_us']:.1f}x"])
    rows.append(["floor: write + fdatasync", str(int(s_floor["n"])), c.fmt_us(s_floor["median_us"]),
                 c.fmt_us(s_floor["mean_us"]), c.fmt_us(s_floor["p99_us"]), c.fmt_us(s_floor["min_us"]),
                 "1.0x"])
    rep.figures = {"cases": figs, "msg_bytes": args.msg_bytes, "build_s": build_s,
                   "snapshot_every_turns": SNAPSHOT_EVERY}
    rep.say(f"persist: one turn through the client (2 appends + fdatasync each), {args.n} per case, "
            f"round-robin; histories built in {build_s:.1f} s; a snapshot every {SNAPSHOT_EVERY} turns")
    rep.table(["session", "n", "median", "mean", "p99", "min", "vs floor"], rows)
    for h in HANDLERS:
        short = figs[f"{h}_{args.short}"]
        long = figs[f"{h}_{args.history}"]
        rep.say(f"  {h}: mean {long['mean_us'] / short['mean_us']:.2f}x, p99 "
                f"{long['p99_us'] / short['p99_us']:.2f}x (long vs short; the snapshot turns)")
    c.history_goals(rep, args, HANDLERS, lambda case: figs[case]["median_us"], 2.0,
                    "turn with {history:,} prior turns within 2x of {short}")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
