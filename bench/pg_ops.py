"""The PostgreSQL store's creates and removals off the daemon's loop (issue
15) against a build that makes them on the loop: how long a daemon `ping`
waits during a storm of creates and removals.

    .venv/bin/python bench/pg_ops.py [--base main] [--rounds 3] [--secs 3] [--clients 4] [--json]

Starts a real PostgreSQL (tests/pg_server.py: from the distribution's
binaries, a Unix socket only) and two daemons on it, each in a schema of
its own:

- `new`: this tree, where a create's row is written by the store's writer
  thread (one statement for every create waiting) and a removal is queued
  behind the session's commits, neither on the loop;
- `base`: the same daemon from `--base` (a git ref, extracted with `git
  archive` into a temp dir and put first on PYTHONPATH), where each create
  and each removal is a synchronous round trip, and its WAL flush, on the
  daemon's loop.

For each round, for each daemon in turn (interleaved, so the machine's
noise hits both alike), a child process runs --clients connections that
create an echo session and remove it, back to back, for --secs seconds;
meanwhile this process sends daemon `ping`s, 2 ms apart, on its own
connection.  With --file, a third daemon (this tree, the file store) shows
the floor: what the storm costs a ping without any database.  Printed: creates/s, create and rm latency, ping latency
(medians and p99 over every round), and the ratio of the ping figures.

Goal: the ping p99 during the storm better than the base build's.
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

sys.path.insert(1, str(_path.REPO / "tests"))

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from typing import Any

import tomli_w

from bench import _common as c

from ipc.loop import run as loop_run
from pg_server import PgServer
from supervisor.ctl.client import AsyncClient

WARMUP_SECS = 0.3
PING_GAP_SECS = 0.002
CONFIG = """
[agent.limits]
max_concurrent_sessions = 1000
"""


# ---------------------------------------------------------------- the storm (a child process)


async def _storm(socket: str, secs: float, clients: int, outfile: str) -> None:
    creates: list[int] = []
    removes: list[int] = []
    until = time.monotonic() + WARMUP_SECS + secs

    async def one() -> None:
        client = await AsyncClient.connect(socket, client_name="bench-pg-ops")
        try:
            while time.monotonic() < until:
                t0 = time.monotonic_ns()
                sid = (await client.create(handler="echo")).id
                t1 = time.monotonic_ns()
                await client.remove(sid)
                t2 = time.monotonic_ns()
                if t0 > warm_ns:
                    creates.append(t1 - t0)
                    removes.append(t2 - t1)
        finally:
            await client.close()

    warm_ns = time.monotonic_ns() + int(WARMUP_SECS * 1e9)
    await asyncio.gather(*(one() for _ in range(clients)))
    Path(outfile).write_text(json.dumps({"creates": creates, "removes": removes, "secs": secs}))


# ---------------------------------------------------------------- one daemon


def _extract(ref: str) -> Path:
    """`ref`'s daemon, worker and protocol packages, in a temp dir."""
    root = Path(tempfile.mkdtemp(prefix="pg-ops-base-"))
    c.on_exit(lambda: shutil.rmtree(root, ignore_errors=True))
    archive = subprocess.run(["git", "-C", str(_path.REPO), "archive", ref, "supervisor", "ipc",
                              "session_worker"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


class _Daemon:
    def __init__(self, name: str, pg: PgServer, env: dict[str, str], postgres: bool = True) -> None:
        self.name = name
        config = CONFIG + (tomli_w.dumps({"store": {"backend": "postgres", "dsn": pg.fresh_dsn()}})
                           if postgres else "")
        self.d = c.BenchDaemon(config, tag="pgo", env=env)
        self.creates: list[int] = []
        self.removes: list[int] = []
        self.pings: list[int] = []
        self.created = 0.0  # creates/s, summed over rounds
        self.rounds = 0

    async def start(self) -> AsyncClient:
        self.d.start(timeout=60)
        return await AsyncClient.connect(str(self.d.socket), client_name="bench-pg-ping")

    async def round(self, client: AsyncClient, secs: float, clients: int) -> None:
        outfile = self.d.dir / f"storm-{self.rounds}.json"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--_storm", str(self.d.socket), str(secs),
            str(clients), str(outfile), env=c.child_env(), stdin=subprocess.DEVNULL)
        c.on_exit(lambda: proc.returncode is None and proc.kill())
        await asyncio.sleep(WARMUP_SECS + 0.3)  # the storm's connects and warm-up
        until = time.monotonic() + secs - 0.4
        while time.monotonic() < until:
            t0 = time.monotonic_ns()
            await client.ping()
            self.pings.append(time.monotonic_ns() - t0)
            await asyncio.sleep(PING_GAP_SECS)
        if await proc.wait() != 0:
            raise RuntimeError(f"the storm failed:\n{self.d.log()[-3000:]}")
        res = json.loads(outfile.read_text())
        self.creates += res["creates"]
        self.removes += res["removes"]
        self.created += len(res["creates"]) / res["secs"]
        self.rounds += 1


async def _run(pg: PgServer, base: Path, rounds: int, secs: float, clients: int, file: bool) -> list[_Daemon]:
    daemons = [_Daemon("base", pg, {"PYTHONPATH": str(base)}), _Daemon("new", pg, {})]
    if file:
        daemons.append(_Daemon("new, file store", pg, {}, postgres=False))
    async with c.clients_of(daemons) as pingers:
        for r in range(rounds):
            order = list(zip(daemons, pingers))
            for d, client in order if r % 2 == 0 else reversed(order):
                await d.round(client, secs, clients)
    return daemons


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_storm":
        _, _, socket, secs, clients, outfile = sys.argv
        loop_run(_storm(socket, float(secs), int(clients), outfile))
        return 0
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--base", default="main", help="git ref of the build to compare with (default main)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per daemon (default 3)")
    p.add_argument("--secs", type=float, default=3.0, help="seconds per round (default 3)")
    p.add_argument("--clients", type=int, default=4, help="connections creating and removing (default 4)")
    p.add_argument("--file", action="store_true", help="also this tree with the file store: the floor")
    args = p.parse_args()
    rep = c.Report("pg_ops", args.json)
    c.quiet_gc()
    base = _extract(args.base)
    rep.say(f"base: {args.base}; starting PostgreSQL ...")
    pg = PgServer()
    c.on_exit(pg.close)
    daemons = loop_run(_run(pg, base, args.rounds, args.secs, args.clients, args.file))
    figures: dict[str, dict[str, Any]] = {}
    for d in daemons:
        figures[d.name] = {"creates_per_sec": d.created / max(d.rounds, 1), "create": c.summarize(d.creates),
                           "rm": c.summarize(d.removes), "ping": c.summarize(d.pings)}
    rep.figures = {"base": args.base, "clients": args.clients, "daemons": figures}
    rows = []
    for name, f in figures.items():
        rows.append([name, f"{f['creates_per_sec']:.0f}", c.fmt_us(f["create"]["median_us"]),
                     c.fmt_us(f["create"]["p99_us"]), c.fmt_us(f["rm"]["median_us"]), c.fmt_us(f["rm"]["p99_us"]),
                     c.fmt_us(f["ping"]["median_us"]), c.fmt_us(f["ping"]["p99_us"]), str(f["ping"]["n"])])
    rep.table(["build", "creates/s", "create p50", "create p99", "rm p50", "rm p99", "ping p50", "ping p99",
               "pings"], rows)
    new, old = figures["new"]["ping"], figures["base"]["ping"]
    rep.say(f"ping during the storm, base / new: median {old['median_us'] / new['median_us']:.2f}x, "
            f"p99 {old['p99_us'] / new['p99_us']:.2f}x")
    rep.goal("pg_ops_ping_p99", new["p99_us"], old["p99_us"],
             f"{args.clients} clients creating and removing: daemon ping p99 {c.fmt_us(new['p99_us'])} new vs "
             f"{c.fmt_us(old['p99_us'])} base (goal: better)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
