"""Many users at once, their sessions at their own uids: creates and a turn
each, what each user lists, and all of it again after a daemon SIGKILL.

    .venv/bin/python bench/users.py [--users 20] [--sessions 100] [--live 200]
                                    [--in-flight 8] [--baseline DIR] [--json]

As root.  One daemon as operators run it for many people: the default
`session_uid_range` (each session's worker and tools at a uid of their
own), `allow_root_tools = false`, `max_concurrent_sessions = --live`.
--users children, each a client uid of its own (admitted by allowed_uids),
each create --sessions echo sessions, --in-flight at a time, and send each
a turn; then each lists what it sees.  The daemon is SIGKILLed and started
again on the same state, and each user lists again and sends a turn to one
of its sessions (a revive).

Figures: the wall time for every create and turn, the refusals and errors
(with --users x --in-flight below --live none is right: every create can
find a slot; above it a refusal is right), whether each user listed
exactly its own sessions before and after the restart, the live workers'
distinct uids (none root), the revive's median and max.  Goal: no error,
no refusal where slots suffice, every user's list whole and its own.

--baseline DIR runs the same, in the same run, with another checkout's
daemon (its PYTHONPATH), e.g. a worktree of the commit before a change;
the baseline runs first.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import asyncio
import contextlib
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import _common as c

from ipc.loop import run as loop_run
from supervisor.ctl.client import AsyncClient

# Client uids no user has: BASE_UID + i for user i.
BASE_UID = 4_100_000

CONFIG = """
[agent.limits]
max_concurrent_sessions = {live}

[daemon]
socket_mode = "0666"
allow_root_tools = false
allowed_uids = [{uids}]

[tools]
disk_quota = "measured"
"""


async def _create_and_turn(client: AsyncClient, n: int, in_flight: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(in_flight)
    out: dict[str, Any] = {"errors": [], "made": 0}

    async def one() -> None:
        async with sem:
            try:
                sid = (await client.create(handler="echo")).id
                out["made"] += 1
                await client.send_text(sid, "hi")
            except Exception as exc:  # counted and shown: the figure is how many
                out["errors"].append(f"{type(exc).__name__}: {exc}")

    await asyncio.gather(*(one() for _ in range(n)))
    return out


def _as_user(d: c.BenchDaemon, i: int, phase: str, args: Any) -> tuple[int, int]:
    """User i's child, started: it runs `phase` (c.as_uid_result collects it)."""
    async def run() -> dict[str, Any]:
        client = await AsyncClient.connect(str(d.socket), client_name=f"bench-user-{i}")
        out: dict[str, Any] = {}
        if phase == "create":
            out.update(await _create_and_turn(client, args.sessions, args.in_flight))
        listed = await client.list()
        out["listed"] = len(listed)
        out["owners"] = sorted({s.owner_uid for s in listed})
        if phase == "after" and listed:
            t0 = time.perf_counter()
            await client.send_text(listed[len(listed) // 2].id, "again")
            out["revive_s"] = time.perf_counter() - t0
        await client.close()
        return out

    return c.as_uid_start(BASE_UID + i, lambda: loop_run(run()))


def _all_users(d: c.BenchDaemon, phase: str, args: Any) -> list[dict[str, Any]]:
    kids = [_as_user(d, i, phase, args) for i in range(args.users)]
    outs = []
    for kid in kids:
        try:
            outs.append(c.as_uid_result(kid))
        except RuntimeError as exc:
            outs.append({"fatal": str(exc)})
    return outs


async def _everyone(d: c.BenchDaemon) -> list[Any]:
    client = await AsyncClient.connect(str(d.socket), client_name="bench-users-root")
    try:
        return list(await client.list())
    finally:
        await client.close()


def _own_lists(outs: list[dict[str, Any]], n: int) -> int:
    """How many users listed exactly their n sessions, theirs only."""
    return sum(1 for i, o in enumerate(outs) if o.get("listed") == n and o.get("owners") == [BASE_UID + i])


def _side(args: Any, repo: str | None) -> dict[str, Any]:
    import psutil

    uids = ", ".join(str(BASE_UID + i) for i in range(args.users))
    d = c.BenchDaemon(CONFIG.format(live=args.live, uids=uids), tag="bench-users",
                      env={"PYTHONPATH": repo} if repo else None)
    d.dir.chmod(0o711)  # the users reach the socket
    d.start()
    try:
        t0 = time.perf_counter()
        outs = _all_users(d, "create", args)
        wall = time.perf_counter() - t0
        errors = [e for o in outs for e in o.get("errors", [])] + [o["fatal"] for o in outs if "fatal" in o]
        # The sessions' workers (not the spares the zygote keeps forked
        # ahead, which take a session's uid when one claims them).
        pids = {s.pid for s in loop_run(_everyone(d)) if s.pid}
        workers = [w for w in psutil.Process(d.zygote_pid()).children() if w.pid in pids]
        worker_uids = [w.uids().real for w in workers]
        os.kill(d.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            psutil.Process(d.pid).wait(10)
        d.start(timeout=120)
        after = _all_users(d, "after", args)
        revives = sorted(o["revive_s"] for o in after if "revive_s" in o)
        errors += [o["fatal"] for o in after if "fatal" in o]
        return {
            "wall_s": wall,
            "made": sum(o.get("made", 0) for o in outs),
            "refusals": sum(1 for e in errors if "live sessions" in e),
            "errors": len(errors),
            "error_sample": errors[:3],
            "own_lists_before": _own_lists(outs, args.sessions),
            "own_lists_after": _own_lists(after, args.sessions),
            "listed_before": sum(o.get("listed", 0) for o in outs),
            "listed_after": sum(o.get("listed", 0) for o in after),
            "workers": len(workers),
            "worker_uids_distinct": len(set(worker_uids)),
            "root_workers": worker_uids.count(0),
            "revive_median_s": statistics.median(revives) if revives else float("nan"),
            "revive_max_s": revives[-1] if revives else float("nan"),
        }
    finally:
        d.cleanup()


def main() -> int:
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--sessions", type=int, default=100, help="sessions per user")
    p.add_argument("--live", type=int, default=200)
    p.add_argument("--in-flight", type=int, default=8, help="creates at once per user")
    p.add_argument("--baseline", metavar="DIR", help="another checkout's daemon, run first, side by side")
    args = p.parse_args()
    if os.geteuid() != 0:
        p.error("run as root: the users are uids of their own")
    rep = c.Report("users", args.json)
    sides: dict[str, dict[str, Any]] = {}
    if args.baseline:
        rep.say(f"baseline ({args.baseline}) ...")
        sides["baseline"] = _side(args, str(Path(args.baseline).resolve()))
    rep.say("this tree ...")
    sides["this"] = _side(args, None)
    rep.figures.update(sides)
    n = args.users * args.sessions
    rows = [
        ("creates and a turn each, wall", lambda f: f"{f['wall_s']:.1f} s"),
        ("sessions made", lambda f: f"{f['made']} of {n}"),
        ("refusals (all live sessions busy)", lambda f: str(f["refusals"])),
        ("errors, refusals included", lambda f: str(f["errors"])),
        ("sessions the users list", lambda f: str(f["listed_before"])),
        ("users listing exactly their own", lambda f: f"{f['own_lists_before']} of {args.users}"),
        ("sessions' live workers: distinct uids", lambda f: f"{f['worker_uids_distinct']} of {f['workers']}"),
        ("sessions' live workers as root", lambda f: str(f["root_workers"])),
        ("after SIGKILL: sessions the users list", lambda f: str(f["listed_after"])),
        ("after SIGKILL: users listing their own", lambda f: f"{f['own_lists_after']} of {args.users}"),
        ("revive after SIGKILL, median", lambda f: f"{f['revive_median_s'] * 1000:.0f} ms"),
        ("revive after SIGKILL, max", lambda f: f"{f['revive_max_s'] * 1000:.0f} ms"),
    ]
    rep.say()
    rep.say(f"{args.users} users x {args.sessions} echo sessions, {args.in_flight} creates at once each, "
            f"{args.live} live at most, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}:")
    rep.table(["figure", *sides], [[name, *(fmt(f) for f in sides.values())] for name, fmt in rows])
    f = sides["this"]
    for e in f["error_sample"]:
        rep.say(f"  error: {e}")
    if args.users * args.in_flight < args.live:
        rep.goal("users_no_error", f["errors"], 0, f"{f['errors']} errors with slots for every create at once "
                 "(goal 0)")
    rep.goal("users_own_lists", args.users - min(f["own_lists_before"], f["own_lists_after"]), 0,
             f"{min(f['own_lists_before'], f['own_lists_after'])} of {args.users} users listed exactly their "
             "own sessions before and after the SIGKILL (goal all)")
    rep.goal("users_no_root_workers", f["root_workers"], 0, f"{f['root_workers']} workers as root (goal 0)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
