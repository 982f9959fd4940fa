"""Many sessions at once: durable turns/s, turn latency, and how long a
control request waits behind them.

    .venv/bin/python bench/load.py [--ns 1,10,50,200] [--secs 4] [--slow-ms 3] [--json]

For each N in --ns, N echo sessions send 100-byte inputs back to back
(`AsyncClient.send_text`, one connection each, all in one load-generator
process on uvloop, the daemon's Python client as a user would run it) for
--secs seconds after a short warm-up.  Meanwhile this process, on its own
connection, sends a control request every 10 ms on a fixed schedule (open
loop: each build is asked the same, however fast it answers), in turn:
daemon `ping`, `status` of one busy session, `ls`.  Printed per N:
total durable turns/s (a turn counts once TurnDone arrived: its input and
its commit are on disk), turn p50/p99, and each control request's p50/p99.

The baseline is N = 1 in the same run (and an idle-daemon ping before the
load, alone and beside 3 busy-loop processes: what a ping costs when
every CPU is taken but the daemon has nothing to do, the scheduler's
floor for the 50-session figure), so the goals are ratios: with 50 sessions the total is >= 3x the
one-session figure; ping p99 <= 2 ms.  With --baseline [LABEL=]DIR (another
checkout, e.g. `git worktree add /tmp/base <commit>`; may be repeated)
that checkout's daemon runs beside this one, level by level, and a last
table gives the ratios between each baseline and this build.

Where the daemon's CPU goes (--trace DIR): during the control window of
each N, every build's daemon is watched by `perf stat` (its system calls
per turn: loop passes are epoll_waits, writes, reads, fdatasyncs, futex
waits of the GIL hand-off) and, if installed, `py-spy record` (samples on
a CPU, as collapsed stacks in DIR/<build>-<N>.txt).  Both cost the daemon
CPU: compare builds traced in the same run, not against an untraced run.

CPU weighting: unless --unweighted no, this checkout also runs a second
daemon side by side, built the same but with `[daemon] session_nice = 0`
(workers and tools at the daemon's CPU weight, no cpu cgroup weight: the
build before CPU weighting), labelled `unweighted`; a last table gives
ping p99 and turns/s of both and their ratios (this / unweighted), and the
ping p99 of each while 3 sessions' tools burn a CPU each (the floor's 3
hogs, now the sessions' own: what weighting is for).

Slow disk: with --slow-ms X (default 3; 0 skips it) the whole table is
measured again with the daemon started with SESSIOND_path.BENCH_FSYNC_DELAY_MS=X,
which makes the file store sleep X ms before every fdatasync/fsync of a log,
a stand-in for network block storage (bench-only: see supervisor/store/files.py).
A daemon that fsyncs once per turn caps at ~1000/X turns/s whatever N; one
that groups commits scales with the batch.
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Any

import psutil

from bench import _common as c

from ipc.loop import run as loop_run
from supervisor.ctl.client import AsyncClient

TEXT = ("0123456789" * 10)[:100]
WARMUP_SECS = 0.5
CONTROL_GAP_SECS = 0.002  # between the floor's pings (closed loop: nothing else runs)
CONTROL_EVERY_SECS = 0.01  # under load: ping, status, ls in turn, 100 a second (open loop)
RENICE = 0
BATCH = False
UNWEIGHTED = True
THIS_CONFIG = ""  # --config: TOML appended to this build's config
TRACE: Path | None = None
SPY_FLAGS: list[str] = os.environ.get("LOAD_SPY_FLAGS", "").split()
# Counted by --trace, per turn (perf's tracepoints; the daemon, all threads).
TRACED_SYSCALLS = ("epoll_wait", "epoll_pwait", "read", "recvfrom", "write", "writev", "sendmsg",
                   "fdatasync", "futex", "eventfd2")
HOGS = 3  # busy-loop processes for the scheduler-floor ping (2 vCPUs here)
CONFIG = """
[agent]
allowed_handlers = ["echo", "bench.bench_handlers:*", "bench._burn_handler:*"]
[agent.limits]
max_concurrent_sessions = 1000
"""


# ---------------------------------------------------------------- the load generator (a child process)


async def _load(sock: str, sids: list[str], secs: float) -> dict[str, Any]:
    clients = [await AsyncClient.connect(sock, client_name="bench-load") for _ in sids]
    lat: list[int] = []
    count = 0
    start = time.monotonic()
    measure_from = start + WARMUP_SECS
    stop_at = measure_from + secs

    async def one(client: AsyncClient, sid: str) -> None:
        nonlocal count
        while True:
            t0 = time.monotonic_ns()
            await client.send_text(sid, TEXT)
            now = time.monotonic()
            if now >= stop_at:
                return
            if now >= measure_from:
                lat.append(time.monotonic_ns() - t0)
                count += 1

    await asyncio.gather(*(one(cl, sid) for cl, sid in zip(clients, sids)))
    for cl in clients:
        await cl.close()
    return {"turns": count, "secs": secs, "lat_ns": lat}


def _load_main(argv: list[str]) -> int:
    sock, secs, out = argv[0], float(argv[1]), argv[2]
    sids = argv[3].split(",")
    result = loop_run(_load(sock, sids, secs))
    Path(out).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- control latency (this process)


async def _control(sock: str, busy: str, until: float) -> dict[str, list[int]]:
    """Open loop: one request every CONTROL_EVERY_SECS on a fixed schedule,
    whether or not the earlier ones were answered, so that every build is
    asked the same (a closed loop asked a quicker daemon more often: the
    pacer's build answered 3-4x as many `ls` of 200 sessions as the
    build before it, ~10% of its CPU per turn).  Each kind on its own
    connection: a ping does not wait for the reply to an `ls` sent
    before it on the same stream (it still waits for the daemon to
    finish one it is answering)."""
    out: dict[str, list[int]] = {"ping": [], "status": [], "ls": []}
    kinds = list(out)
    conns = {k: await AsyncClient.connect(sock, client_name=f"bench-{k}") for k in kinds}

    async def one(kind: str) -> None:
        client = conns[kind]
        t0 = time.monotonic_ns()
        if kind == "ping":
            await client.ping()
        elif kind == "status":
            await client.status(busy)
        else:
            await client.list()
        out[kind].append(time.monotonic_ns() - t0)

    tasks = []
    start = time.monotonic()
    i = 0
    while True:
        at = start + i * CONTROL_EVERY_SECS
        if at >= until:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        tasks.append(asyncio.ensure_future(one(kinds[i % len(kinds)])))
        i += 1
    await asyncio.gather(*tasks)
    for conn in conns.values():
        await conn.close()
    return out


def _worker_pids(d: c.BenchDaemon) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(d.zygote_pid()).children()]
    except (psutil.Error, RuntimeError):
        return []


def _cpu(daemon: int, load: int, workers: list[int]) -> dict[str, int]:
    """ns on a CPU so far: the daemon (all its threads), the load generator,
    all workers together."""
    run, wait = c.sched_ns(daemon)
    return {"daemon": run, "client": c.sched_ns(load)[0],
            "workers": sum(c.sched_ns(w)[0] for w in workers),
            "daemon_runq": wait}


async def _level(d: c.BenchDaemon, client: AsyncClient, sids: list[str], secs: float,
                 label: str = "this") -> dict[str, Any]:
    outfile = d.dir / f"load-{len(sids)}.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--_load", str(d.socket), str(secs), str(outfile), ",".join(sids),
        env=c.child_env(), stdin=subprocess.DEVNULL,
    )
    c.on_exit(lambda: proc.returncode is None and proc.kill())
    # Control requests while the load runs (after its warm-up and connects).
    await asyncio.sleep(WARMUP_SECS + 0.3)
    workers = _worker_pids(d)
    if RENICE:
        # An experiment (--renice): the daemon first when CPUs are short.
        for pid in [*workers, proc.pid]:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, RENICE)
    if BATCH:
        # An experiment (--batch): workers and the load generator under
        # SCHED_BATCH, so a worker woken by the daemon never preempts it
        # (same share of CPU, no wake-up preemption).
        for pid in [*workers, proc.pid]:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(pid, os.SCHED_BATCH, os.sched_param(0))
    window = secs - 0.6
    tracers = _trace_start(d.pid, f"{label}-{len(sids)}", window) if TRACE is not None else []
    cpu0 = _cpu(d.pid, proc.pid, workers)
    t0 = time.monotonic()
    control = await _control(str(d.socket), sids[0], time.monotonic() + window)
    cpu1 = _cpu(d.pid, proc.pid, workers)
    wall = time.monotonic() - t0
    syscalls = await _trace_end(tracers, f"{label}-{len(sids)}")
    rc = await proc.wait()
    if rc != 0:
        raise RuntimeError(f"load generator exited {rc}:\n{d.log()[-3000:]}")
    res = json.loads(outfile.read_text())
    turns = c.summarize(res["lat_ns"])
    rate = res["turns"] / res["secs"]
    return {
        "n": len(sids),
        # CPU per durable turn, µs, over the control window (both cores count).
        "cpu_us_per_turn": {k: (cpu1[k] - cpu0[k]) / 1000 / max(rate * wall, 1) for k in cpu0},
        "turns_per_sec": rate,
        "turn": turns,
        "control": {k: c.summarize(v) for k, v in control.items()},
        # --trace: system calls of the daemon per durable turn.
        "syscalls_per_turn": {k: v / max(rate * wall, 1) for k, v in syscalls.items()},
    }


def _trace_start(pid: int, name: str, secs: float) -> list[subprocess.Popen[bytes]]:
    """perf stat (and py-spy, if installed) on the daemon for `secs`."""
    import shutil

    assert TRACE is not None
    TRACE.mkdir(parents=True, exist_ok=True)
    events = ",".join(f"syscalls:sys_enter_{n}" for n in TRACED_SYSCALLS)
    if shutil.which("perf") is None:
        raise SystemExit("--trace needs perf (linux-perf) on PATH")
    procs = [subprocess.Popen(
        ["perf", "stat", "-x,", "-o", str(TRACE / f"{name}.perf"), "-e", events, "-p", str(pid),
         "--", "sleep", f"{secs:.2f}"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if Path(spy).exists():
        procs.append(subprocess.Popen(
            [spy, "record", "--format", "raw", "--rate", "250", "--nonblocking", *SPY_FLAGS, "-d", str(int(secs) + 5),
             "-o", str(TRACE / f"{name}.txt"), "-p", str(pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(TRACE / f"{name}.py-spy.log", "wb")))
    return procs


async def _trace_end(procs: list[subprocess.Popen[bytes]], name: str) -> dict[str, float]:
    if not procs:
        return {}
    for spy in procs[1:]:
        spy.send_signal(signal.SIGINT)  # py-spy takes whole seconds: stop it here, it writes its file
    while any(p.poll() is None for p in procs):
        await asyncio.sleep(0.05)
    assert TRACE is not None
    counts: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in (TRACE / f"{name}.perf").read_text().splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2].startswith("syscalls:sys_enter_"):
                with contextlib.suppress(ValueError):
                    counts[fields[2].removeprefix("syscalls:sys_enter_")] = float(fields[0])
    return counts


async def _burning(client: AsyncClient, sid: str) -> bool:
    pid = (await client.status(sid)).pid
    if pid is None:
        return False
    try:  # bench._burn_handler's loop, a child of the worker
        return any("while time.monotonic()" in " ".join(p.cmdline()) for p in psutil.Process(pid).children())
    except psutil.Error:
        return False


async def _burning_pings(client: AsyncClient) -> dict[str, float]:
    """The same pings as the floor's, the CPU hogs now HOGS sessions' own
    processes (a turn of bench._burn_handler each, as a busy tool): what
    CPU weighting gives the control plane against busy sessions."""
    sids = [(await client.create(handler="bench._burn_handler:burner")).id for _ in range(HOGS)]
    turns = [asyncio.ensure_future(client.send_text(sid, "burn 2.5")) for sid in sids]
    try:
        deadline = time.monotonic() + 10  # until every hog burns (its turn's process started)
        while time.monotonic() < deadline and not all([await _burning(client, sid) for sid in sids]):
            await asyncio.sleep(0.02)
        return c.summarize(await _pings(client, 300, CONTROL_GAP_SECS))
    finally:
        await asyncio.gather(*turns, return_exceptions=True)
        for sid in sids:
            with contextlib.suppress(Exception):
                await client.remove(sid)


async def _pings(client: AsyncClient, n: int, gap: float = 0.0) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.monotonic_ns()
        await client.ping()
        out.append(time.monotonic_ns() - t0)
        if gap:
            await asyncio.sleep(gap)
    return out


class _Build:
    """One daemon under test: this checkout, or --baseline's (another
    checkout of sessiond, e.g. a `git worktree` of the commit before)."""

    def __init__(self, label: str, repo: str | None, env: dict[str, str], flags: list[str],
                 config: str = "") -> None:
        self.label = label
        extra = dict(env)
        if repo is not None:
            extra["PYTHONPATH"] = repo
        self.d = c.BenchDaemon(CONFIG + config, tag="load", env=extra, python_flags=flags)
        self.sids: list[str] = []
        self.idle: dict[str, float] = {}
        self.hogged: dict[str, float] = {}
        self.burning: dict[str, float] = {}
        self.levels: list[dict[str, Any]] = []

    async def start(self) -> AsyncClient:
        self.d.start()
        client = await AsyncClient.connect(str(self.d.socket), client_name="bench-control")
        self.idle = c.summarize(await _pings(client, 300))
        # The scheduler's floor: the same pings, nothing for the daemon to
        # do, but every CPU busy (as with 50 sessions): the daemon and this
        # process wait for a CPU on each wake-up.
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
                for _ in range(HOGS)]
        try:
            await asyncio.sleep(0.2)
            self.hogged = c.summarize(await _pings(client, 300, CONTROL_GAP_SECS))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        self.burning = await _burning_pings(client)
        return client

    async def grow(self, client: AsyncClient, n: int) -> None:
        sem = asyncio.Semaphore(16)

        async def make() -> None:
            async with sem:
                self.sids.append((await client.create(handler="echo")).id)

        await asyncio.gather(*(make() for _ in range(n - len(self.sids))))
        self.d.remember()


async def _run_mode(ns: list[int], secs: float, fsync_delay_ms: float, baselines: list[tuple[str, str]],
                    profile: str | None = None, rotate: int = 0) -> list[dict[str, Any]]:
    """Every N on every build, interleaved (base N=1, this N=1, base N=10...);
    `rotate`: which build goes first.  Returned in the order: baselines
    (the unweighted one last of them), this."""
    env = {"SESSIOND_path.BENCH_FSYNC_DELAY_MS": str(fsync_delay_ms)} if fsync_delay_ms else {}
    flags = ["-m", "cProfile", "-o", profile] if profile else []
    builds = [_Build(label, repo, env, []) for label, repo in baselines]
    if UNWEIGHTED:
        builds.append(_Build("unweighted", None, env, [], "[daemon]\nsession_nice = 0\n"))
    builds.append(_Build("this", None, env, flags, THIS_CONFIG))
    try:
        k = rotate % len(builds)
        order = builds[k:] + builds[:k]
        clients = [await b.start() for b in order]
        for n in ns:
            for b, client in zip(order, clients):
                await b.grow(client, n)
                b.levels.append(await _level(b.d, client, sorted(b.sids)[:n], secs, b.label))
        for client in clients:
            await client.close()
    finally:
        for b in builds:
            b.d.cleanup()
    return [{"build": b.label, "fsync_delay_ms": fsync_delay_ms, "idle_ping": b.idle,
             "hogged_ping": b.hogged, "burning_ping": b.burning, "levels": b.levels}
            for b in builds]


def _print(rep: c.Report, mode: dict[str, Any]) -> None:
    slow = mode["fsync_delay_ms"]
    rep.say()
    rep.say(f"== {mode['build']}, {'fsync +' + str(slow) + ' ms (SESSIOND_path.BENCH_FSYNC_DELAY_MS)' if slow else 'real disk'}: "
            f"idle daemon ping p50 {c.fmt_us(mode['idle_ping']['median_us'])}, "
            f"p99 {c.fmt_us(mode['idle_ping']['p99_us'])}; with {HOGS} CPU hogs and no sessions busy "
            f"(the scheduler's floor) p50 {c.fmt_us(mode['hogged_ping']['median_us'])}, "
            f"p99 {c.fmt_us(mode['hogged_ping']['p99_us'])}; with {HOGS} sessions burning a CPU each "
            f"p50 {c.fmt_us(mode['burning_ping']['median_us'])}, p99 {c.fmt_us(mode['burning_ping']['p99_us'])}")
    base = mode["levels"][0]["turns_per_sec"] or 1.0
    rows = []
    for lv in mode["levels"]:
        ctl = lv["control"]
        rows.append([
            str(lv["n"]), f"{lv['turns_per_sec']:.0f}", f"{lv['turns_per_sec'] / base:.2f}x",
            c.fmt_us(lv["turn"]["median_us"]), c.fmt_us(lv["turn"]["p99_us"]),
            c.fmt_us(ctl["ping"]["median_us"]), c.fmt_us(ctl["ping"]["p99_us"]),
            c.fmt_us(ctl["status"]["median_us"]), c.fmt_us(ctl["status"]["p99_us"]),
            c.fmt_us(ctl["ls"]["median_us"]), c.fmt_us(ctl["ls"]["p99_us"]),
            " / ".join(f"{lv['cpu_us_per_turn'][k]:.0f}" for k in ("daemon", "workers", "client")),
            f"{lv['cpu_us_per_turn']['daemon_runq']:.0f}",
        ])
    rep.table(["sessions", "turns/s", f"vs N={mode['levels'][0]['n']}", "turn p50", "turn p99",
               "ping p50", "ping p99", "status p50", "status p99", "ls p50", "ls p99",
               "CPU µs/turn daemon / workers / client", "daemon runq µs/turn"], rows)
    if any(lv.get("syscalls_per_turn") for lv in mode["levels"]):
        names = [n for n in TRACED_SYSCALLS
                 if any(lv["syscalls_per_turn"].get(n) for lv in mode["levels"])]
        rep.say(f"{mode['build']}: the daemon's system calls per turn (--trace, perf stat)")
        rep.table(["sessions", *names],
                  [[str(lv["n"]), *(f"{lv['syscalls_per_turn'].get(n, 0):.2f}" for n in names)]
                   for lv in mode["levels"]])


def _median(xs: list[float]) -> float:
    return c.percentile(sorted(xs), 50) if xs else float("nan")


def _compare(rep: c.Report, runs: list[list[dict[str, Any]]]) -> None:
    """Each baseline against this build, paired within each run; medians
    over the runs (with one run, that run's figures)."""
    rows = []
    first = runs[0]
    for i, mode in enumerate(first):
        if mode["build"] == "this":
            continue
        j = next(k for k in range(i, len(first)) if first[k]["build"] == "this"
                 and first[k]["fsync_delay_ms"] == mode["fsync_delay_ms"])
        for li, lv in enumerate(mode["levels"]):
            pairs = [(run[i], run[j]) for run in runs]

            def med(f: Any) -> float:
                return _median([f(b, t) for b, t in pairs])

            def lvl(m: dict[str, Any]) -> dict[str, Any]:
                return m["levels"][li]  # type: ignore[no-any-return]

            cpu = ("daemon", "workers", "client")
            rows.append([
                f"+{mode['fsync_delay_ms']} ms" if mode["fsync_delay_ms"] else "real",
                mode["build"], str(lv["n"]),
                f"{med(lambda b, t: lvl(t)['turns_per_sec'] / max(lvl(b)['turns_per_sec'], 1e-9)):.2f}x",
                f"{med(lambda b, t: lvl(b)['turns_per_sec']):.0f} / {med(lambda b, t: lvl(t)['turns_per_sec']):.0f}",
                " / ".join(f"{med(lambda b, t, k=k: lvl(b)['cpu_us_per_turn'][k]):.0f}" for k in cpu) + "  vs  "
                + " / ".join(f"{med(lambda b, t, k=k: lvl(t)['cpu_us_per_turn'][k]):.0f}" for k in cpu),
                f"{c.fmt_us(med(lambda b, t: lvl(b)['control']['ping']['median_us']))} / "
                f"{c.fmt_us(med(lambda b, t: lvl(t)['control']['ping']['median_us']))}",
                f"{c.fmt_us(med(lambda b, t: lvl(b)['control']['ping']['p99_us']))} / "
                f"{c.fmt_us(med(lambda b, t: lvl(t)['control']['ping']['p99_us']))}",
                f"{c.fmt_us(med(lambda b, t: b['hogged_ping']['p99_us']))} / "
                f"{c.fmt_us(med(lambda b, t: t['hogged_ping']['p99_us']))}",
            ])
    rep.say()
    rep.say(f"this build against each baseline, paired in each run, median of {len(runs)} run(s):")
    rep.table(["disk", "baseline", "sessions", "turns/s this / base", "turns/s base / this",
               "CPU µs/turn daemon / workers / client: base  vs  this",
               "ping p50 base / this", "ping p99 base / this", "floor p99 base / this"], rows)


def _weighting(rep: c.Report, runs: list[list[dict[str, Any]]]) -> None:
    """This build (session_nice at its default) against the same checkout
    with session_nice = 0, paired in each run: medians of the figures and
    of the per-run ratios."""
    rows = []
    for mode_i, mode in enumerate(runs[0]):
        if mode["build"] != "unweighted":
            continue
        this_i = next(k for k in range(mode_i, len(runs[0])) if runs[0][k]["build"] == "this")
        burn = [(run[mode_i]["burning_ping"]["p99_us"], run[this_i]["burning_ping"]["p99_us"]) for run in runs]
        rows.append([
            f"+{mode['fsync_delay_ms']} ms" if mode["fsync_delay_ms"] else "real", f"{HOGS} burning",
            f"{c.fmt_us(_median([u for u, _ in burn]))} / {c.fmt_us(_median([t for _, t in burn]))}",
            f"{_median([t / max(u, 1e-9) for u, t in burn]):.2f}x", "-", "-",
        ])
        for li, lv in enumerate(mode["levels"]):
            pairs = [(run[mode_i]["levels"][li], run[this_i]["levels"][li]) for run in runs]
            p99 = [(u["control"]["ping"]["p99_us"], t["control"]["ping"]["p99_us"]) for u, t in pairs]
            tps = [(u["turns_per_sec"], t["turns_per_sec"]) for u, t in pairs]
            rows.append([
                f"+{mode['fsync_delay_ms']} ms" if mode["fsync_delay_ms"] else "real", str(lv["n"]),
                f"{c.fmt_us(_median([u for u, _ in p99]))} / {c.fmt_us(_median([t for _, t in p99]))}",
                f"{_median([t / max(u, 1e-9) for u, t in p99]):.2f}x",
                f"{_median([u for u, _ in tps]):.0f} / {_median([t for _, t in tps]):.0f}",
                f"{_median([t / max(u, 1e-9) for u, t in tps]):.2f}x",
            ])
    if not rows:
        return
    rep.say()
    rep.say(f"CPU weighting: session_nice = 0 (unweighted) against the default (this), paired in each run, "
            f"median of {len(runs)} run(s):")
    rep.table(["disk", "sessions", "ping p99 unweighted / this", "p99 this/unweighted",
               "turns/s unweighted / this", "turns/s this/unweighted"], rows)


def _baseline(arg: str) -> tuple[str, str]:
    """--baseline [LABEL=]DIR."""
    label, sep, repo = arg.partition("=")
    if not sep:
        label, repo = "baseline", arg
    if not (Path(repo) / "supervisor").is_dir():
        raise SystemExit(f"--baseline {arg}: {repo} is not a checkout of sessiond")
    return label, str(Path(repo).resolve())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_load":
        return _load_main(sys.argv[2:])
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--ns", default="1,10,50,200", help="session counts (default 1,10,50,200)")
    p.add_argument("--secs", type=float, default=4.0, help="seconds measured per count (default 4)")
    p.add_argument("--profile", metavar="FILE", help="run the (real-disk) daemon under cProfile, "
                   "stats written to FILE at its exit")
    p.add_argument("--baseline", metavar="[LABEL=]DIR", action="append", type=_baseline, default=[],
                   help="also run another checkout's daemon (e.g. `git worktree add /tmp/base COMMIT`), "
                   "interleaved with this one, level by level; may be repeated")
    p.add_argument("--trace", metavar="DIR", help="count the daemons' system calls per turn (perf stat) "
                   "and sample them (py-spy, if installed) into DIR during each level")
    p.add_argument("--runs", type=int, default=1, help="repeat everything this many times; with "
                   "--baseline, medians of the paired figures (default 1)")
    p.add_argument("--slow-ms", type=float, default=3.0,
                   help="also run with this fsync delay, ms (default 3; 0: skip)")
    p.add_argument("--renice", type=int, default=0, metavar="N",
                   help="experiment: run workers and the load generator at nice N (default 0: as started)")
    p.add_argument("--batch", action="store_true",
                   help="experiment: run workers and the load generator under SCHED_BATCH")
    p.add_argument("--unweighted", choices=("yes", "no"), default="yes",
                   help="also run this checkout with [daemon] session_nice = 0, side by side (default yes)")
    p.add_argument("--config", default="", metavar="TOML",
                   help="TOML appended to this build's config (not the baselines'), e.g. "
                   "'[daemon]\\nsession_nice = 5'")
    args = p.parse_args()
    global RENICE, BATCH, TRACE, UNWEIGHTED, THIS_CONFIG
    UNWEIGHTED = args.unweighted == "yes"
    THIS_CONFIG = args.config.replace("\\n", "\n")
    RENICE = args.renice
    BATCH = args.batch
    TRACE = Path(args.trace).resolve() if args.trace else None
    ns = sorted({int(x) for x in args.ns.split(",")})
    rep = c.Report("load", args.json)
    c.quiet_gc()
    profile = str(Path(args.profile).resolve()) if args.profile else None
    runs: list[list[dict[str, Any]]] = []
    for r in range(args.runs):
        # Each run starts with another build first (order matters on a busy
        # machine: the first daemon of a level meets fresher CPUs).
        real_modes = loop_run(_run_mode(ns, args.secs, 0.0, args.baseline, profile if r == 0 else None, r))
        slow_modes = loop_run(_run_mode(ns, args.secs, args.slow_ms, args.baseline, None, r)) if args.slow_ms else []
        runs.append(real_modes + slow_modes)
        if args.runs == 1:
            for mode in runs[-1]:
                _print(rep, mode)
        else:
            rep.say(f"run {r + 1} of {args.runs}: " + "; ".join(
                f"{'+' + str(m['fsync_delay_ms']) + ' ms ' if m['fsync_delay_ms'] else ''}{m['build']} "
                + " ".join(f"N={lv['n']} {lv['turns_per_sec']:.0f}/s p99 {c.fmt_us(lv['control']['ping']['p99_us'])}"
                           for lv in m["levels"]) for m in runs[-1]))
    modes = runs[-1]
    rep.figures["modes"] = modes
    rep.figures["runs"] = runs
    if args.baseline or UNWEIGHTED:
        _compare(rep, runs)
    if UNWEIGHTED:
        _weighting(rep, runs)
    real = real_modes[-1]["levels"]
    by_n = {lv["n"]: lv for lv in real}
    if 1 in by_n and 50 in by_n:
        ratio = by_n[50]["turns_per_sec"] / max(by_n[1]["turns_per_sec"], 1e-9)
        rep.goal("load_50_vs_1", ratio, 3.0, f"50 sessions {ratio:.2f}x one session's turns/s (goal >= 3x)",
                 higher_is_better=True)
        p99 = by_n[50]["control"]["ping"]["p99_us"]
        floor = real_modes[-1]["hogged_ping"]["p99_us"]
        rep.goal("load_50_ping_p99", p99, 2000.0, f"daemon ping p99 with 50 sessions busy {c.fmt_us(p99)} "
                 f"(goal <= 2 ms; the scheduler's floor in this run, CPUs busy, no sessions: "
                 f"{c.fmt_us(floor)})")
    if slow_modes:
        slow = {lv["n"]: lv for lv in slow_modes[-1]["levels"]}
        top = max(slow)
        cap = 1000.0 / slow_modes[-1]["fsync_delay_ms"]
        got = slow[top]["turns_per_sec"]
        rep.goal("load_slow_fsync_scales", got / cap, 2.0,
                 f"slow fsync, {top} sessions: {got:.0f} turns/s = {got / cap:.1f}x the one-fsync-per-turn "
                 f"cap of {cap:.0f}/s (goal >= 2x: throughput scales with the batch)", higher_is_better=True)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
