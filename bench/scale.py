"""Many sessions on one box: what each hibernated and each live session costs
the daemon, and what stays fast as the count grows.

    .venv/bin/python bench/scale.py [--n 20000] [--live 500] [--batch 1000]
                                    [--user-sessions 100] [--revives 50]
                                    [--idle-secs 10] [--restart-only N]
                                    [--baseline DIR] [--json]

One daemon (echo sessions, `max_concurrent_sessions = --live`, so that past
the first --live creates every create makes room by hibernating the least
recently used idle session):

- create: --n sessions, 16 creates in flight, in batches of --batch; per
  batch the rate, and after it the daemon's RSS, open fds and live workers.
  The first and the last batch side by side (goal: the last within 1.5x
  the first; >= 150/s with eviction on 2 cores);
- cost per session: the daemon's RSS and fds per live session (from an
  empty daemon to the first --live sessions, all live) and per hibernated
  session (from there to the end, where --n - --live are hibernated);
  goal 0 fds and <= 4 KiB per hibernated session;
- ls: `sessionctl --json ls` of everything (a new process, as a user runs
  it; goal <= 1 s), and of one user's --user-sessions (goal <= 50 ms):
  that user's sessions are made by a child of this process that becomes
  another uid (allowed_uids), and it lists them through the Python client
  and through the one-shot sessionctl path's `--owner` filter as root;
- revive: a turn sent to --revives hibernated sessions, one at a time
  (median, p99), each revive hibernating another to make room;
- idle: the daemon's CPU over --idle-secs with every session idle;
- restart: SIGKILL of the daemon, then the time until a new daemon on the
  same state directory answers `ping` (a hello and a ping answered, not a
  connect: the socket listens before the daemon serves), until it has
  served a turn on an old (hibernated) session, the one it would load last
  (goal <= 5 s for both at 100,000), and until it has loaded every session;
  and `ping`'s round trip meanwhile (median, max), every 50 ms.

--restart-only N measures only the restart, with N sessions on disk made
without a daemon (tests/stored.py: echo sessions of one turn each, written
with the file store's API at thousands a second), e.g. 100000: the daemon
is started on them, left to load them all, then SIGKILLed and started again.

--baseline DIR runs the same stages, in the same run, with another
checkout's daemon (its PYTHONPATH), e.g. a worktree of the commit before a
change, and prints both side by side.  Each side gets its own state
directory; the baseline runs first.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import time
from typing import Any

from bench import _common as c

from ipc.loop import run as loop_run
from supervisor.ctl.client import AsyncClient
from supervisor.ctl.errors import DaemonUnavailable

sys.path.insert(1, str(c.REPO / "tests"))
from stored import echo_sessions  # noqa: E402  (tests/: state directories made without a daemon)

# The uid whose sessions `ls` of one user lists: a uid no user has, admitted
# by allowed_uids.  Sessions run as the daemon's user (as root: no uid of
# their own), so no uid range is used up.
USER_UID = 4_000_017
IN_FLIGHT = 16

# The workspaces walked, not an ext4 image each: as root "auto" makes one
# per session (mkfs, a loop device, a mount: ~0.3 s, and a mount per
# session), which would measure the kernel's disk caps, not the daemon.
CONFIG = """
[agent.limits]
max_concurrent_sessions = {live}

[daemon]
socket_mode = "0666"
allowed_uids = [{uid}]
session_uid_range = ""

[tools]
disk_quota = "measured"
"""

ONE_SHOT = [sys.executable, "-c", "from supervisor.ctl.fast import run; run()"]


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _workers(zygote: int) -> int:
    import psutil

    with contextlib.suppress(psutil.Error):
        return len(psutil.Process(zygote).children())
    return -1


def _as_user(d: c.BenchDaemon, n: int, rounds: int) -> list[float]:
    """In a child that becomes USER_UID: create n sessions, then time
    `rounds` listings of what that user sees (the Python client, warm)."""
    async def run() -> list[float]:
        client = await AsyncClient.connect(str(d.socket), client_name="bench-scale-user")
        await c.create_echo_sessions(client, n, IN_FLIGHT)
        out = await c.time_lists(client, rounds)
        await client.close()
        return out

    try:
        times: list[float] = c.as_uid(USER_UID, lambda: loop_run(run()))
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{d.log()[-3000:]}") from None
    return times


def _ctl_ls(d: c.BenchDaemon, *args: str, rounds: int) -> float:
    env = c.cached_env(d.dir / "pycache")
    cmd = [*ONE_SHOT, "--socket", str(d.socket), "--json", "ls", *args]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)  # warms the bytecode cache
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _revives(d: c.BenchDaemon, sids: list[str], k: int) -> list[float]:
    client = await AsyncClient.connect(str(d.socket), client_name="bench-scale-revive")
    out = []
    try:
        for sid in sids[:k]:
            t0 = time.perf_counter()
            await client.send_text(sid, "wake")
            out.append(time.perf_counter() - t0)
    finally:
        await client.close()
    return out


async def _answered(d: c.BenchDaemon, t0: float, timeout: float = 900.0) -> tuple[AsyncClient, float]:
    """A client once the daemon answers its hello and a ping; seconds since t0."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = await AsyncClient.connect(str(d.socket), client_name="bench-scale-restart")
            await client.ping()
            return client, time.perf_counter() - t0
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


async def _loaded(client: AsyncClient, n: int, t0: float) -> tuple[float, list[float]]:
    """Seconds since t0 until every one of `n` sessions is loaded (an older
    daemon loads them before it answers); ping round trips meanwhile."""
    rtts: list[float] = []
    while True:
        stats = await client.stats()  # (every 0.5 s: it counts every session loaded, on the loop)
        if stats.loading is None and stats.sessions >= n:
            return time.perf_counter() - t0, sorted(rtts)
        for _ in range(10):
            t1 = time.perf_counter()
            await client.ping()
            rtts.append(time.perf_counter() - t1)
            await asyncio.sleep(0.05)


def _restart(d: c.BenchDaemon, old: str, n: int) -> dict[str, Any]:
    """SIGKILL the daemon and start it again: seconds to a ping answered,
    to a turn served on `old`, to every session loaded; pings meanwhile."""
    assert d.proc is not None
    d.remember()
    os.kill(d.pid, signal.SIGKILL)
    d.proc.wait()
    # Its workers die with it (PDEATHSIG on the zygote, then the zygote's kill).
    t0 = time.perf_counter()
    while True:
        try:
            d.start(timeout=900)
            break
        except RuntimeError as exc:  # the old zygote (and its lock's fd) not gone yet: as systemd would, again
            if "is in use by another sessiond" not in str(exc) or time.perf_counter() - t0 > 60:
                raise
            time.sleep(0.05)

    async def run() -> dict[str, Any]:
        client, pinged = await _answered(d, t0)
        try:
            await client.send_text(old, "after the restart")
            served = time.perf_counter() - t0
            loaded, rtts = await _loaded(client, n, t0)
        finally:
            await client.close()
        return {"sigkill_to_ping_s": pinged, "sigkill_to_turn_s": served, "sigkill_to_loaded_s": loaded,
                "ping_while_loading_median_s": c.percentile(rtts, 50) if rtts else float("nan"),
                "ping_while_loading_max_s": rtts[-1] if rtts else float("nan")}

    return loop_run(run())


def _restart_side(args: Any, repo: str | None, rep: c.Report) -> dict[str, Any]:
    """--restart-only: N sessions on disk, made without a daemon."""
    env = {"PYTHONPATH": repo} if repo else {}
    d = c.BenchDaemon(CONFIG.format(live=args.live, uid=USER_UID), tag="scale", env=env)
    try:
        ids = [f"s{i:06d}" for i in range(args.restart_only)]
        t0 = time.perf_counter()
        echo_sessions(d.state_dir, ids, os.getuid())
        rep.say(f"  {len(ids)} sessions written in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        d.start(timeout=900)

        async def first() -> float:
            client, _ = await _answered(d, t0)
            try:
                return (await _loaded(client, len(ids), t0))[0]
            finally:
                await client.close()

        rep.say(f"  first start: every session loaded after {loop_run(first()):.1f} s")
        # The id sorted last: the background load reaches it last.
        figures = _restart(d, ids[-1], len(ids))
    finally:
        d.cleanup()
    return {"n": len(ids), **figures}


def _side(args: Any, repo: str | None, rep: c.Report) -> dict[str, Any]:
    env = {"PYTHONPATH": repo} if repo else {}
    d = c.BenchDaemon(CONFIG.format(live=args.live, uid=USER_UID), tag="scale", env=env).start()
    d.dir.chmod(0o711)  # the user's child reaches the socket (admitted by allowed_uids)
    try:
        zygote = d.zygote_pid()
        empty = (_rss(d.pid), _fds(d.pid))
        batches: list[dict[str, Any]] = []
        sids: list[str] = []
        at_live: tuple[int, int, int] | None = None

        async def create_all() -> None:
            nonlocal at_live
            client = await AsyncClient.connect(str(d.socket), client_name="bench-scale")
            try:
                # The first --live creates on their own: the daemon with every
                # session live, before any hibernation (the per-live cost).
                made = 0
                while made < args.n:
                    size = min(args.batch, args.n - made, args.live - made if made < args.live else args.batch)
                    rate, new = await c.create_echo_sessions(client, size, IN_FLIGHT)
                    sids.extend(new)
                    made += size
                    d.remember()
                    row = {"sessions": made, "rate": rate, "rss": _rss(d.pid), "fds": _fds(d.pid),
                           "live": _workers(zygote)}
                    batches.append(row)
                    rep.say(f"  {row['sessions']:>7} sessions  {rate:7.0f}/s  daemon {c.fmt_bytes(row['rss'])}, "
                            f"{row['fds']} fds, {row['live']} workers")
                    if made == args.live:
                        at_live = (row["rss"], row["fds"], row["live"])
            finally:
                await client.close()

        loop_run(create_all())
        assert at_live is not None
        end = (_rss(d.pid), _fds(d.pid))
        hibernated = len(sids) - at_live[2]
        per_live = ((at_live[0] - empty[0]) / max(1, at_live[2]), (at_live[1] - empty[1]) / max(1, at_live[2]))
        per_hib = ((end[0] - at_live[0]) / max(1, hibernated), (end[1] - at_live[1]) / max(1, hibernated))
        # Rates of batches made with eviction (past --live), first vs last.
        evicting = [b["rate"] for b in batches if b["sessions"] > args.live]
        user_times = _as_user(d, args.user_sessions, 20)
        ls_all = _ctl_ls(d, rounds=5)
        ls_owner = _ctl_ls(d, "--owner", str(USER_UID), rounds=5)
        # The oldest sessions are the hibernated ones (least recently used).
        rev = sorted(loop_run(_revives(d, sids[: args.live], args.revives)))
        time.sleep(1.0)
        c0 = c.sched_ns(d.pid)[0]
        t0 = time.monotonic()
        time.sleep(args.idle_secs)
        idle_pct = (c.sched_ns(d.pid)[0] - c0) / 1e9 / (time.monotonic() - t0) * 100
        restarted = _restart(d, sids[-1 - args.live], len(sids))
    finally:
        d.cleanup()
    return {
        "n": len(sids), "live": at_live[2], "batches": batches,
        "first_batch_rate": evicting[0] if evicting else float("nan"),
        "last_batch_rate": evicting[-1] if evicting else float("nan"),
        "rss_per_live": per_live[0], "fds_per_live": per_live[1],
        "rss_per_hibernated": per_hib[0], "fds_per_hibernated": per_hib[1],
        "daemon_rss_end": end[0], "daemon_fds_end": end[1],
        "ls_all_s": ls_all, "ls_owner_s": ls_owner,
        "ls_user_client_s": statistics.median(user_times),
        "revive_median_s": c.percentile(rev, 50), "revive_p99_s": c.percentile(rev, 99),
        "idle_cpu_pct": idle_pct, **restarted,
    }


def main() -> int:
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20_000)
    p.add_argument("--live", type=int, default=500)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--user-sessions", type=int, default=100)
    p.add_argument("--revives", type=int, default=50)
    p.add_argument("--idle-secs", type=float, default=10.0)
    p.add_argument("--restart-only", type=int, metavar="N", default=0,
                   help="only the restart figures, with N sessions on disk made without a daemon")
    p.add_argument("--baseline", metavar="DIR", help="another checkout's daemon, run first, side by side")
    args = p.parse_args()
    if args.n <= args.live and not args.restart_only:
        p.error("--n must be above --live (the bench measures hibernated sessions)")
    rep = c.Report("scale", args.json)
    side = _restart_side if args.restart_only else _side
    sides: dict[str, dict[str, Any]] = {}
    if args.baseline:
        rep.say(f"baseline ({args.baseline}):")
        sides["baseline"] = side(args, str(Path(args.baseline).resolve()), rep)
    rep.say("this tree:")
    sides["this"] = side(args, None, rep)
    rep.figures.update(sides)
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    restart_rows = [
        ("SIGKILL -> ping", lambda f: f"{f['sigkill_to_ping_s']:.2f} s"),
        ("SIGKILL -> a turn on an old session", lambda f: f"{f['sigkill_to_turn_s']:.2f} s"),
        ("SIGKILL -> every session loaded", lambda f: f"{f['sigkill_to_loaded_s']:.2f} s"),
        ("ping while loading, median", lambda f: ms(f["ping_while_loading_median_s"])),
        ("ping while loading, max", lambda f: ms(f["ping_while_loading_max_s"])),
    ]
    if args.restart_only:
        rep.say()
        rep.say(f"{args.restart_only} echo sessions on disk, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}:")
        rep.table(["figure", *sides], [[name, *(fmt(f) for f in sides.values())] for name, fmt in restart_rows])
        f = sides["this"]
        rep.goal("scale_restart_ping", f["sigkill_to_ping_s"], 5.0,
                 f"SIGKILL -> ping: {f['sigkill_to_ping_s']:.2f} s (goal <= 5 s)")
        rep.goal("scale_restart", f["sigkill_to_turn_s"], 5.0,
                 f"SIGKILL -> serving a turn: {f['sigkill_to_turn_s']:.2f} s (goal <= 5 s)")
        return rep.finish()
    rows = [
        ("create/s, first batch with eviction", lambda f: f"{f['first_batch_rate']:.0f}"),
        ("create/s, last batch", lambda f: f"{f['last_batch_rate']:.0f}"),
        ("daemon RSS per live session", lambda f: f"{f['rss_per_live'] / 1024:.1f} KiB"),
        ("daemon fds per live session", lambda f: f"{f['fds_per_live']:.2f}"),
        ("daemon RSS per hibernated session", lambda f: f"{f['rss_per_hibernated'] / 1024:.1f} KiB"),
        ("daemon fds per hibernated session", lambda f: f"{f['fds_per_hibernated']:.2f}"),
        ("daemon RSS, fds at the end", lambda f: f"{c.fmt_bytes(f['daemon_rss_end'])}, {f['daemon_fds_end']}"),
        ("sessionctl --json ls, all", lambda f: ms(f["ls_all_s"])),
        (f"sessionctl --json ls --owner (its {args.user_sessions})", lambda f: ms(f["ls_owner_s"])),
        ("the user's own list (client, warm)", lambda f: ms(f["ls_user_client_s"])),
        ("revive (turn to a hibernated), median", lambda f: ms(f["revive_median_s"])),
        ("revive, p99", lambda f: ms(f["revive_p99_s"])),
        ("idle daemon CPU", lambda f: f"{f['idle_cpu_pct']:.1f}%"),
        *restart_rows,
    ]
    rep.say()
    rep.say(f"{args.n} echo sessions, {args.live} live at most, {os.cpu_count()} CPUs, load "
            f"{os.getloadavg()[0]:.1f}:")
    rep.table(["figure", *sides], [[name, *(fmt(f) for f in sides.values())] for name, fmt in rows])
    f = sides["this"]
    rep.goal("scale_create_flat", f["last_batch_rate"] / f["first_batch_rate"], 1 / 1.5,
             f"last batch {f['last_batch_rate']:.0f}/s vs first with eviction {f['first_batch_rate']:.0f}/s "
             "(goal: within 1.5x)", higher_is_better=True)
    rep.goal("scale_create_rate", f["last_batch_rate"], 150.0,
             f"create with eviction {f['last_batch_rate']:.0f}/s (goal >= 150/s)", higher_is_better=True)
    rep.goal("scale_fds_hibernated", f["fds_per_hibernated"], 0.01,
             f"{f['fds_per_hibernated']:.2f} fds per hibernated session (goal 0)")
    rep.goal("scale_rss_hibernated", f["rss_per_hibernated"], 4096.0,
             f"{f['rss_per_hibernated'] / 1024:.1f} KiB per hibernated session (goal <= 4 KiB)")
    rep.goal("scale_ls_all", f["ls_all_s"], 1.0, f"ls of {f['n']}: {ms(f['ls_all_s'])} (goal <= 1 s)")
    rep.goal("scale_ls_user", f["ls_owner_s"], 0.05,
             f"ls of one user's {args.user_sessions}: {ms(f['ls_owner_s'])} (goal <= 50 ms)")
    rep.goal("scale_restart_ping", f["sigkill_to_ping_s"], 5.0,
             f"SIGKILL -> ping: {f['sigkill_to_ping_s']:.2f} s (goal <= 5 s)")
    rep.goal("scale_restart", f["sigkill_to_turn_s"], 5.0,
             f"SIGKILL -> serving a turn: {f['sigkill_to_turn_s']:.2f} s (goal <= 5 s)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
