"""Turn latency and throughput with Prometheus metrics off vs on, scraped
every 100 ms, side by side in one run.

    .venv/bin/python bench/metrics.py [--turns 600] [--phases 6] [--phase-secs 2]
                                      [--sessions 20] [--concurrency 8] [--json]

Two daemons with the same config, except that one has
`[daemon] metrics_listen = "127.0.0.1:0"`; another process scrapes that one's
/metrics every 100 ms for the whole run (the way a Prometheus with a very
short scrape interval would), so what is measured includes the exposition
competing with the turns for the daemon's loop.  Each daemon holds
--sessions live echo sessions, so a scrape has sessions to walk.

(a) latency: one echo turn (`send_text`, two fdatasyncs) at a time,
    alternating between the daemons turn by turn (the order flips every
    round), --turns each: medians and p99.
(b) throughput: --concurrency sessions sending turns back to back for
    --phase-secs, the daemons taking turns phase by phase (off, on, on, off,
    ...), --phases each: the median of the phases' turns per second.

The goal: metrics on costs at most 5% (latency median, throughput median).
The scrape's own latency and size are printed beside.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import json
import re
import statistics
import subprocess
import time
from typing import Any

from bench import _common as c

from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent]
handler = "echo"
[agent.limits]
max_concurrent_sessions = 200
"""
SCRAPE_EVERY_SECS = 0.1


# The scraper runs in a process of its own: as a thread of the bench client
# it would take the client's GIL and slow the turns it is timing.
_SCRAPER = r"""
import json, os, sys, time, urllib.request
url, every, stop = sys.argv[1], float(sys.argv[2]), sys.argv[3]
lat, sizes, errors = [], [], 0
next_at = time.monotonic()
while not os.path.exists(stop):
    t0 = time.perf_counter_ns()
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            sizes.append(len(r.read()))
        lat.append(time.perf_counter_ns() - t0)
    except OSError:
        errors += 1
    next_at += every
    time.sleep(max(0.0, next_at - time.monotonic()))
print(json.dumps({"latencies_ns": lat, "sizes": sizes, "errors": errors}))
"""


class Scraper:
    """GET /metrics every SCRAPE_EVERY_SECS, from another process, until stopped."""

    def __init__(self, url: str, workdir: Path) -> None:
        self.stop_flag = workdir / "stop-scraping"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCRAPER, url, str(SCRAPE_EVERY_SECS), str(self.stop_flag)],
            stdout=subprocess.PIPE, text=True,
        )
        c.on_exit(self.proc.kill)
        self.latencies_ns: list[int] = []
        self.sizes: list[int] = []
        self.errors = 0

    def stop(self) -> None:
        self.stop_flag.touch()
        out, _ = self.proc.communicate(timeout=30)
        if out.strip():
            got = json.loads(out)
            self.latencies_ns, self.sizes, self.errors = got["latencies_ns"], got["sizes"], got["errors"]


def metrics_url(daemon: c.BenchDaemon) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", daemon.log())
        if found:
            return found.group(1)
        time.sleep(0.05)
    raise SystemExit("bench/metrics.py: the daemon did not log its metrics address")


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=600, help="latency: timed turns per daemon (default 600)")
    p.add_argument("--warmup", type=int, default=30, help="untimed turns per daemon first (default 30)")
    p.add_argument("--phases", type=int, default=6, help="throughput: phases per daemon (default 6)")
    p.add_argument("--phase-secs", type=float, default=2.0, help="throughput: seconds a phase (default 2)")
    p.add_argument("--sessions", type=int, default=20, help="live sessions per daemon (default 20)")
    p.add_argument("--concurrency", type=int, default=8, help="throughput: sessions sending at once (default 8)")
    args = p.parse_args()
    rep = c.Report("metrics", args.json)

    off = c.BenchDaemon(CONFIG, tag="sdb-moff").start()
    on = c.BenchDaemon(CONFIG + '[daemon]\nmetrics_listen = "127.0.0.1:0"\n', tag="sdb-mon").start()
    url = metrics_url(on)
    scraper: Scraper | None = None
    latency: dict[str, list[int]] = {"off": [], "on": []}
    throughput: dict[str, list[float]] = {"off": [], "on": []}

    async def run() -> None:
        clients = {"off": await AsyncClient.connect(off.socket, client_name="bench-metrics"),
                   "on": await AsyncClient.connect(on.socket, client_name="bench-metrics")}
        try:
            sids = {k: [(await cl.create()).id for _ in range(args.sessions)] for k, cl in clients.items()}
            c.quiet_gc()
            nonlocal scraper
            scraper = Scraper(url, on.dir)
            for r in range(args.warmup + args.turns):
                order = ("off", "on") if r % 2 == 0 else ("on", "off")
                for k in order:
                    t0 = time.perf_counter_ns()
                    await clients[k].send_text(sids[k][r % args.sessions], c.message(r, 100))
                    if r >= args.warmup:
                        latency[k].append(time.perf_counter_ns() - t0)

            async def phase(k: str) -> float:
                stop_at = time.monotonic() + args.phase_secs
                done = 0

                async def sender(sid: str) -> None:
                    nonlocal done
                    i = 0
                    while time.monotonic() < stop_at:
                        await clients[k].send_text(sid, c.message(i, 100))
                        done += 1
                        i += 1

                t0 = time.monotonic()
                await asyncio.gather(*(sender(s) for s in sids[k][: args.concurrency]))
                return done / (time.monotonic() - t0)

            for ph in range(args.phases):
                for k in (("off", "on") if ph % 2 == 0 else ("on", "off")):
                    throughput[k].append(await phase(k))
        finally:
            for cl in clients.values():
                await cl.close()

    try:
        asyncio.run(run())
    finally:
        if scraper is not None:
            scraper.stop()
        off.cleanup()
        on.cleanup()

    assert scraper is not None
    lat = {k: c.summarize(v) for k, v in latency.items()}
    tput = {k: statistics.median(v) for k, v in throughput.items()}
    scrape = c.summarize(scraper.latencies_ns)
    lat_ratio = lat["on"]["median_us"] / lat["off"]["median_us"]
    tput_ratio = tput["on"] / tput["off"]
    rep.figures = {"latency": lat, "throughput_turns_per_s": tput, "throughput_phases": throughput,
                   "scrape": scrape, "scrape_bytes": statistics.median(scraper.sizes) if scraper.sizes else 0,
                   "scrape_errors": scraper.errors, "sessions": args.sessions}
    rep.say(f"metrics: echo turns, metrics off vs on (scraped every {SCRAPE_EVERY_SECS * 1000:.0f} ms: "
            f"{len(scraper.latencies_ns)} scrapes, {scraper.errors} errors), {args.sessions} live sessions "
            "per daemon, interleaved")
    rep.table(
        ["", "latency median", "p99", "throughput (median of phases)"],
        [[k, c.fmt_us(lat[k]["median_us"]), c.fmt_us(lat[k]["p99_us"]), f"{tput[k]:.0f} turns/s"]
         for k in ("off", "on")]
        + [["on / off", f"{lat_ratio:.3f}x", f"{lat['on']['p99_us'] / lat['off']['p99_us']:.3f}x",
            f"{tput_ratio:.3f}x"]],
    )
    rep.say(f"a scrape: median {c.fmt_us(scrape['median_us'])}, p99 {c.fmt_us(scrape['p99_us'])}, "
            f"{rep.figures['scrape_bytes']:.0f} bytes")
    rep.goal("turn latency with metrics on within 5%", lat_ratio, 1.05, f"{lat_ratio:.3f}x")
    rep.goal("turn throughput with metrics on within 5%", 1 / tput_ratio, 1.05,
             f"{tput_ratio:.3f}x of off")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
