"""The PostgreSQL store's group commit against its synchronous path, on a
loaded daemon: durable turns/s, turn latency, and how long a ping waits.

    .venv/bin/python bench/pg_batch.py [--ns 1,10,50] [--secs 3] [--json]

Starts a real PostgreSQL (tests/pg_server.py: from the distribution's
binaries, a Unix socket only) and two daemons on it, each in a schema of
its own:

- `batched`: the store as it ships, every session's pending commits landed
  by a writer thread as one statement, off the loop (supervisor.store.postgres.batch);
- `synchronous`: the same daemon started with SESSIOND_path.BENCH_PG_BATCH=0
  (bench-only), where every commit is its own round trip made on the
  daemon's loop (the path before group commit).

For each N in --ns, for each daemon in turn (interleaved, so the machine's
noise hits both alike), N echo sessions send 100-byte inputs back to back
for --secs seconds after a short warm-up, from a load-generator child
process (one connection a session, uvloop).  Meanwhile this process sends
daemon `ping`s, 2 ms apart, on its own connection: the loop's latency
under the load.  A turn counts once TurnDone arrived: its input and commit
are durable in PostgreSQL.  Also printed: the server's transactions per
turn (pg_stat_database, every backend of the run's database: under 1 when
commits of several sessions share a statement).

Goals: with 50 sessions busy, batched turns/s >= 2x the synchronous
path's, and the ping p99 under load better than the synchronous path's.
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys

sys.path.insert(1, str(_path.REPO / "tests"))

import asyncio
import json
import subprocess
import time
from typing import Any

import tomli_w

from bench import _common as c

from ipc.loop import run as loop_run
from pg_server import PgServer
from supervisor.ctl.client import AsyncClient

WARMUP_SECS = 0.5  # as load.py's generator
PING_GAP_SECS = 0.002
CONFIG = """
[agent.limits]
max_concurrent_sessions = 1000
"""
MODES = {"synchronous": {"SESSIOND_path.BENCH_PG_BATCH": "0"}, "batched": {}}


# ---------------------------------------------------------------- one daemon, one level


def _xacts(pg: PgServer) -> int:
    import psycopg

    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        row = conn.execute(b"SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           b"WHERE datname = current_database()").fetchone()
    return int(row[0]) if row else 0


class _Daemon:
    def __init__(self, name: str, pg: PgServer) -> None:
        self.name = name
        config = CONFIG + tomli_w.dumps({"store": {"backend": "postgres", "dsn": pg.fresh_dsn()}})
        self.d = c.BenchDaemon(config, tag="pgb", env=MODES[name])
        self.sids: list[str] = []
        self.levels: list[dict[str, Any]] = []

    async def start(self) -> AsyncClient:
        self.d.start(timeout=60)
        return await AsyncClient.connect(str(self.d.socket), client_name="bench-pg-ping")

    async def grow(self, client: AsyncClient, n: int) -> None:
        while len(self.sids) < n:
            self.sids.append((await client.create(handler="echo")).id)
        self.d.remember()

    async def level(self, client: AsyncClient, pg: PgServer, n: int, secs: float) -> None:
        outfile = self.d.dir / f"load-{n}.json"
        x0 = _xacts(pg)
        proc = await asyncio.create_subprocess_exec(
            # load.py's load generator: echo turns back to back, in a child
            sys.executable, str(_path.BENCH / "load.py"), "--_load", str(self.d.socket), str(secs), str(outfile),
            ",".join(self.sids[:n]), env=c.child_env(), stdin=subprocess.DEVNULL)
        c.on_exit(lambda: proc.returncode is None and proc.kill())
        await asyncio.sleep(WARMUP_SECS + 0.3)  # the load's connects and warm-up
        pings: list[int] = []
        until = time.monotonic() + secs - 0.6
        while time.monotonic() < until:
            t0 = time.monotonic_ns()
            await client.ping()
            pings.append(time.monotonic_ns() - t0)
            await asyncio.sleep(PING_GAP_SECS)
        if await proc.wait() != 0:
            raise RuntimeError(f"the load generator failed:\n{self.d.log()[-3000:]}")
        res = json.loads(outfile.read_text())
        # Backends report their counts within a second of going idle.
        await asyncio.sleep(1.2)
        xacts = _xacts(pg) - x0
        self.levels.append({
            "n": n, "turns_per_sec": res["turns"] / res["secs"], "turn": c.summarize(res["lat_ns"]),
            "ping": c.summarize(pings), "xacts_per_turn": xacts / max(res["turns"], 1),
        })


async def _run(pg: PgServer, ns: list[int], secs: float) -> list[_Daemon]:
    daemons = [_Daemon(name, pg) for name in MODES]
    async with c.clients_of(daemons) as clients:
        for n in ns:
            for d, client in zip(daemons, clients):
                await d.grow(client, n)
                await d.level(client, pg, n, secs)
    return daemons


def main() -> int:
    p = c.arg_parser(__doc__.split("\n\n")[0])
    p.add_argument("--ns", default="1,10,50", help="session counts (default 1,10,50)")
    p.add_argument("--secs", type=float, default=3.0, help="seconds measured per count (default 3)")
    args = p.parse_args()
    ns = sorted({int(x) for x in args.ns.split(",")})
    rep = c.Report("pg_batch", args.json)
    c.quiet_gc()
    rep.say("starting PostgreSQL ...")
    pg = PgServer()
    c.on_exit(pg.close)
    daemons = loop_run(_run(pg, ns, args.secs))
    by = {d.name: {lv["n"]: lv for lv in d.levels} for d in daemons}
    rep.figures["levels"] = {d.name: d.levels for d in daemons}
    rows = []
    for n in ns:
        for d in daemons:
            lv = by[d.name][n]
            ratio = lv["turns_per_sec"] / max(by["synchronous"][n]["turns_per_sec"], 1e-9)
            rows.append([str(n), d.name, f"{lv['turns_per_sec']:.0f}", f"{ratio:.2f}x",
                         c.fmt_us(lv["turn"]["median_us"]), c.fmt_us(lv["turn"]["p99_us"]),
                         c.fmt_us(lv["ping"]["median_us"]), c.fmt_us(lv["ping"]["p99_us"]),
                         f"{lv['xacts_per_turn']:.2f}"])
    rep.table(["sessions", "store", "turns/s", "vs sync", "turn p50", "turn p99", "ping p50", "ping p99",
               "pg xacts/turn"], rows)
    top = max(ns)
    batched, sync = by["batched"][top], by["synchronous"][top]
    ratio = batched["turns_per_sec"] / max(sync["turns_per_sec"], 1e-9)
    rep.goal("pg_batch_turns", ratio, 2.0, f"{top} sessions: batched {batched['turns_per_sec']:.0f} turns/s = "
             f"{ratio:.2f}x the synchronous path's (goal >= 2x)", higher_is_better=True)
    rep.goal("pg_batch_ping_p99", batched["ping"]["p99_us"], sync["ping"]["p99_us"],
             f"{top} sessions busy: daemon ping p99 {c.fmt_us(batched['ping']['p99_us'])} batched vs "
             f"{c.fmt_us(sync['ping']['p99_us'])} synchronous (goal: better)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
