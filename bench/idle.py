"""What N idle sessions cost: create throughput, then CPU while nothing happens,
and `sessionctl --json ls`.

    .venv/bin/python bench/idle.py [--n 1000] [--idle-secs 10] [--profile FILE] [--json]
                                   [--ctl-repo DIR] [--ctl-rounds 9]

- create: N echo sessions, 16 creates in flight (`AsyncClient.create`), the
  rate over the whole batch, and the CPU each create cost in every process
  of the chain (daemon, zygote, the new worker's fork and boot, this
  client): the ceiling the machine's CPUs put on the rate at that cost;
- idle: with every session idle, the daemon's CPU (all its threads) and all
  workers' CPU together over --idle-secs, as % of one core, from
  /proc/PID/task/*/schedstat; the default 100 ms memory poll;
- ls: `sessionctl --json ls` as a user runs it (a new process: interpreter
  start included), median of CTL_ROUNDS, through both of sessionctl's paths
  in the same run, interleaved: the one-shot path (supervisor/ctl/fast.py,
  the `sessionctl` entry point: blocking socket, msgpack, no asyncio) and
  the full path (`python -m supervisor.ctl`: asyncio, uvloop, argparse,
  msgspec), each beside a `--json ping` (the same process start, nothing
  listed) and its imports alone (`python -c 'import ...'`); `python -c
  pass` (the interpreter and its site); and the same listing through the
  Python client in this warm process (the daemon's part and the decoding).
  The CLI runs with a bytecode cache (PYTHONPYCACHEPREFIX in a temp dir,
  warmed once), as an installed sessionctl has; the one-shot `ls` is also
  timed without one (PYTHONDONTWRITEBYTECODE=1: our modules compiled at
  every start).  --ctl-repo DIR also times another checkout's one-shot
  `ls`, `ping` and imports in the same rounds, against the same daemon (a
  before and after of a change to sessionctl, side by side).

Goals (issue 12): daemon <= 5% of a core, workers together <= 2%, ls <= 50 ms,
create >= 500 sessions/s.  With --profile the daemon runs under cProfile
(stats written at its exit), to see what an idle daemon spends its time on.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import statistics
import os
import subprocess
import time
from typing import Any

from bench import _common as c

from ipc.loop import run as loop_run
from supervisor.ctl.client import AsyncClient

CTL_ROUNDS = 9

CONFIG = """
[agent.limits]
max_concurrent_sessions = 5000
"""


async def _create(d: c.BenchDaemon, n: int) -> tuple[float, list[str]]:
    client = await AsyncClient.connect(str(d.socket), client_name="bench-idle")
    rate, sids = await c.create_echo_sessions(client, n)
    await client.close()
    return rate, sids


# The one-shot path as the `sessionctl` console script runs it, and the
# full path as `python -m supervisor.ctl`.
ONE_SHOT = [sys.executable, "-c", "from supervisor.ctl.fast import run; run()"]
FULL = [sys.executable, "-m", "supervisor.ctl"]


def _ctl(d: c.BenchDaemon, path: list[str], *args: str, env: dict[str, str]) -> float:
    return _timed([*path, "--socket", str(d.socket), "--json", *args], env)


def _timed(cmd: list[str], env: dict[str, str], cwd: str | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    return time.perf_counter() - t0


def _cli_envs(cache_dir: str) -> tuple[dict[str, str], dict[str, str]]:
    """(with a bytecode cache, without one)."""
    return c.cached_env(cache_dir), c.child_env({"PYTHONDONTWRITEBYTECODE": "1"})


async def _listed(d: c.BenchDaemon, n: int) -> list[float]:
    """The same `ls` through the Python client in this (warm) process:
    the daemon's part plus decoding the reply, no process start."""
    client = await AsyncClient.connect(str(d.socket), client_name="bench-idle")
    out = await c.time_lists(client, n)
    await client.close()
    return out


def main() -> int:
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--idle-secs", type=float, default=10.0)
    p.add_argument("--profile", metavar="FILE")
    p.add_argument("--daemon-repo", metavar="DIR", help="run another checkout's daemon (a baseline)")
    p.add_argument("--ctl-repo", metavar="DIR", help="also time another checkout's one-shot sessionctl")
    p.add_argument("--ctl-rounds", type=int, default=CTL_ROUNDS, help="rounds of the sessionctl timings")
    args = p.parse_args()
    rep = c.Report("idle", args.json)
    flags = ["-m", "cProfile", "-o", str(Path(args.profile).resolve())] if args.profile else []
    env = {"PYTHONPATH": args.daemon_repo} if args.daemon_repo else {}
    d = c.BenchDaemon(CONFIG, tag="idle", python_flags=flags, env=env).start()
    try:
        import psutil

        zygote = d.zygote_pid()
        before = (c.sched_ns(d.pid)[0], c.sched_ns(zygote)[0], time.process_time())
        rate, sids = loop_run(_create(d, args.n))
        d.remember()
        workers = [p.pid for p in psutil.Process(zygote).children()]
        # CPU each create cost, all processes of the chain (a new worker's
        # CPU so far is its fork and boot): the most creates/s this
        # machine's CPUs could do, whatever the daemon's design.
        spent = {"daemon": (c.sched_ns(d.pid)[0] - before[0]) / 1e9,
                 "zygote": (c.sched_ns(zygote)[0] - before[1]) / 1e9,
                 "workers": sum(c.sched_ns(w)[0] for w in workers) / 1e9,
                 "client": time.process_time() - before[2]}
        per_create = {k: v / args.n for k, v in spent.items()}
        ceiling = (os.cpu_count() or 1) / sum(per_create.values())
        time.sleep(1.0)  # let the creates' aftermath (first heartbeats, sweeps) pass
        d0, w0 = c.sched_ns(d.pid)[0], sum(c.sched_ns(w)[0] for w in workers)
        t0 = time.monotonic()
        time.sleep(args.idle_secs)
        wall = time.monotonic() - t0
        d1, w1 = c.sched_ns(d.pid)[0], sum(c.sched_ns(w)[0] for w in workers)
        daemon_pct = (d1 - d0) / 1e9 / wall * 100
        workers_pct = (w1 - w0) / 1e9 / wall * 100
        cached, uncached = _cli_envs(str(d.dir / "pycache"))
        runs: dict[str, Any] = {
            "one-shot ls": lambda: _ctl(d, ONE_SHOT, "ls", env=cached),
            "one-shot ping": lambda: _ctl(d, ONE_SHOT, "ping", env=cached),
            "one-shot imports": lambda: _timed([sys.executable, "-c", "import supervisor.ctl.fast"], cached),
            "one-shot ls, no bytecode cache": lambda: _ctl(d, ONE_SHOT, "ls", env=uncached),
            "full ls": lambda: _ctl(d, FULL, "ls", env=cached),
            "full ping": lambda: _ctl(d, FULL, "ping", env=cached),
            "full imports": lambda: _timed([sys.executable, "-c", "import supervisor.ctl.cli"], cached),
            "python -c pass": lambda: _timed([sys.executable, "-c", "pass"], cached),
        }
        paths = ["one-shot", "full"]
        if args.ctl_repo:
            # `-c` puts the working directory first on sys.path: run there.
            repo = str(Path(args.ctl_repo).resolve())
            other = {**cached, "PYTHONPATH": repo}
            runs.update({
                "baseline one-shot ls": lambda: _timed([*ONE_SHOT, "--socket", str(d.socket), "--json", "ls"],
                                                       other, repo),
                "baseline one-shot ping": lambda: _timed([*ONE_SHOT, "--socket", str(d.socket), "--json", "ping"],
                                                         other, repo),
                "baseline one-shot imports": lambda: _timed([sys.executable, "-c", "import supervisor.ctl.fast"],
                                                            other, repo),
            })
            paths.insert(0, "baseline one-shot")
        for run in runs.values():
            run()  # fills the bytecode cache
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.ctl_rounds):
            for name, run in runs.items():
                times[name].append(run())
        cli_ms = {k: statistics.median(v) * 1000 for k, v in times.items()}
        cli_min_ms = {k: min(v) * 1000 for k, v in times.items()}
        ls_ms, ping_ms = cli_ms["one-shot ls"], cli_ms["one-shot ping"]
        listed_ms = statistics.median(loop_run(_listed(d, 20))) * 1000
    finally:
        d.cleanup()
    fig: dict[str, Any] = {"n": args.n, "create_per_sec": rate, "daemon_cpu_pct": daemon_pct,
                           "workers_cpu_pct": workers_pct, "ls_ms": ls_ms, "ping_ms": ping_ms,
                           "cli_ms": cli_ms, "cli_min_ms": cli_min_ms, "ls_in_process_ms": listed_ms, "workers": len(workers),
                           "cpu_per_create_ms": {k: v * 1000 for k, v in per_create.items()},
                           "create_ceiling_per_sec": ceiling}
    rep.figures.update(fig)
    rep.table(["sessions", "create/s (16 in flight)", "daemon CPU, idle", "workers CPU, idle",
               "sessionctl --json ls", "sessionctl --json ping"],
              [[str(args.n), f"{rate:.0f}", f"{daemon_pct:.1f}%", f"{workers_pct:.1f}%",
                f"{ls_ms:.0f} ms", f"{ping_ms:.0f} ms"]])
    rep.say()
    rep.say(f"`sessionctl --json ls` of {args.n} (medians of {args.ctl_rounds}, same run, interleaved):")
    rep.table(["path", "ls", "ls, fastest", "ping", "its imports", "ls vs the full path"],
              [[p, f"{cli_ms[p + ' ls']:.0f} ms", f"{cli_min_ms[p + ' ls']:.0f} ms", f"{cli_ms[p + ' ping']:.0f} ms",
                f"{cli_ms[p + ' imports']:.0f} ms", f"{cli_ms['full ls'] / cli_ms[p + ' ls']:.2f}x"]
               for p in paths])
    rep.say(f"python -c pass {cli_ms['python -c pass']:.0f} ms; the one-shot ls without a bytecode "
            f"cache {cli_ms['one-shot ls, no bytecode cache']:.0f} ms; the listing in a warm "
            f"client (daemon + decode) {listed_ms:.1f} ms")
    rep.say()
    rep.say(f"CPU per create, every process of the chain (a worker's: its fork and boot); "
            f"{os.cpu_count()} CPUs can do at most {ceiling:.0f} creates/s at that cost:")
    rep.table(list(per_create), [[f"{v * 1000:.2f} ms" for v in per_create.values()]])
    rep.goal("idle_daemon_cpu", daemon_pct, 5.0, f"{args.n} idle sessions: daemon {daemon_pct:.1f}% of a core "
             "(goal <= 5%)")
    rep.goal("idle_workers_cpu", workers_pct, 2.0, f"{args.n} idle workers together {workers_pct:.1f}% "
             "(goal <= 2%)")
    rep.goal("idle_ls_ms", ls_ms, 50.0, f"`sessionctl --json ls` of {args.n}: {ls_ms:.0f} ms, a ping from the "
             f"same command {ping_ms:.0f} ms (goal <= 50 ms)")
    rep.goal("create_rate", rate, 500.0, f"create {rate:.0f} sessions/s with 16 in flight, the CPUs' "
             f"ceiling at this CPU per create {ceiling:.0f}/s (goal >= 500)",
             higher_is_better=True)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
