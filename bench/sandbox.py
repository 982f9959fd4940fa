"""The sandbox's cost: create -> ready, a bash tool call, idle memory; on vs off.

    .venv/bin/python bench/sandbox.py [--n 200] [--calls 300] [--json]

What is timed, each variant interleaved with its baseline in the same run:
* create: `AsyncClient.create(handler="echo")` against two daemons, one with
  `[sandbox] mode = "auto"` and one with `mode = "off"`, alternating.  The
  tool host is started at a session's first tool call, so create should not
  move (goal: +2 ms at most).
* tool call: `run_bash("true")` as the agent's bash tool runs it, in this
  process: unconfined (the worker starts bash itself), through the tool
  host with Landlock and seccomp only, and through the tool host inside
  bubblewrap's namespaces; steady state (the host already up; goal: +5 ms
  at most), and separately the first call of a session, which starts the
  host.
* idle memory: PSS and USS of idle echo workers of both daemons (the host
  does not exist until a tool runs; goal: unchanged within 10%).
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import shutil
import tempfile
import time

from bench import _common as c

import psutil

from ipc import messages as m
from ipc.settings import SessionSettings
from session_worker.worker import sandbox
from session_worker.agent._bash import run_bash
from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent.limits]
max_concurrent_sessions = 1000
[sandbox]
mode = "{mode}"
"""


async def time_creates(on: c.BenchDaemon, off: c.BenchDaemon, n: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"create-on": [], "create-off": []}
    async with await AsyncClient.connect(on.socket) as con, await AsyncClient.connect(off.socket) as coff:
        for i in range(n):
            pairs = (("create-on", con), ("create-off", coff))
            for name, client in pairs if i % 2 else pairs[::-1]:
                t = time.perf_counter_ns()
                info = await client.create(handler="echo")
                out[name].append(time.perf_counter_ns() - t)
                await client.remove(info.id)
    return out


def idle_memory(daemon: c.BenchDaemon, count: int) -> tuple[float, float]:
    async def make() -> list[int]:
        async with await AsyncClient.connect(daemon.socket) as client:
            pids = []
            for _ in range(count):
                info = await client.create(handler="echo")
                await client.send_text(info.id, "warm")
                pids.append((await client.status(info.id)).pid)
            return pids

    pids = asyncio.run(make())
    time.sleep(0.5)
    pss = uss = 0.0
    for pid in pids:
        full = psutil.Process(pid).memory_full_info()
        pss += full.pss
        uss += full.uss
    return pss / len(pids), uss / len(pids)


async def time_tool_calls(calls: int, firsts: int) -> dict[str, list[int]]:
    ws = Path(tempfile.mkdtemp(prefix="sdb-sandbox-ws-"))
    c.on_exit(lambda: shutil.rmtree(ws, ignore_errors=True))
    settings = SessionSettings()
    bwrap = shutil.which("bwrap") or ""
    plans = {
        "off": None,
        "landlock": sandbox.plan_for(m.SandboxBoot(namespaces=False), settings, ws, per_session_uid=False),
        "namespaces": sandbox.plan_for(m.SandboxBoot(namespaces=bool(bwrap), bwrap=bwrap), settings, ws,
                                       per_session_uid=False),
    }
    hosts = {name: sandbox.ToolHost(plan) if plan else None for name, plan in plans.items()}
    out: dict[str, list[int]] = {name: [] for name in plans}
    out.update({f"first-{name}": [] for name in plans if name != "off"})

    async def one(name: str) -> int:
        sandbox._current = hosts[name]  # noqa: SLF001 (the worker's one host, swapped per variant)
        t = time.perf_counter_ns()
        result = await run_bash("true", ws, 30, 4096)
        assert result.endswith("[exit code: 0]"), result
        return time.perf_counter_ns() - t

    for name in plans:  # start the hosts (not timed here)
        await one(name)
    for _ in range(calls):
        for name in plans:
            out[name].append(await one(name))
    for _ in range(firsts):
        for name, plan in plans.items():
            if plan is None:
                continue
            hosts[name] = sandbox.ToolHost(plan)
            out[f"first-{name}"].append(await one(name))
            hosts[name].close()
    for host in hosts.values():
        if host is not None:
            host.close()
    return out


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=200, help="creates per daemon")
    p.add_argument("--calls", type=int, default=300, help="tool calls per variant")
    p.add_argument("--firsts", type=int, default=20, help="first calls (host start) per variant")
    p.add_argument("--idle", type=int, default=20, help="idle workers per daemon for memory")
    args = p.parse_args()
    rep = c.Report("sandbox", args.json)
    c.quiet_gc()

    on = c.BenchDaemon(CONFIG.format(mode="auto"), tag="sdb-sbx-on").start()
    off = c.BenchDaemon(CONFIG.format(mode="off"), tag="sdb-sbx-off").start()
    creates = asyncio.run(time_creates(on, off, args.n))
    pss_on, uss_on = idle_memory(on, args.idle)
    pss_off, uss_off = idle_memory(off, args.idle)
    on.cleanup()
    off.cleanup()
    calls = asyncio.run(time_tool_calls(args.calls, args.firsts))

    s = {k: c.summarize(v) for k, v in {**creates, **calls}.items()}
    rows = []
    rep.say("create -> ready (echo), sandbox on vs off, alternating")
    rep.table(["daemon", "n", "median", "p99", "vs off"], [
        [name, str(int(s[name]["n"])), c.fmt_us(s[name]["median_us"]), c.fmt_us(s[name]["p99_us"]),
         f"{s[name]['median_us'] - s['create-off']['median_us']:+.0f} µs"] for name in ("create-on", "create-off")
    ])
    rep.say()
    rep.say("bash tool call `true` (steady state: the session's host already up)")
    for name in ("off", "landlock", "namespaces"):
        rows.append([name, str(int(s[name]["n"])), c.fmt_us(s[name]["median_us"]), c.fmt_us(s[name]["p99_us"]),
                     f"{s[name]['median_us'] - s['off']['median_us']:+.0f} µs"])
    for name in ("first-landlock", "first-namespaces"):
        rows.append([name + " (starts the host)", str(int(s[name]["n"])), c.fmt_us(s[name]["median_us"]),
                     c.fmt_us(s[name]["p99_us"]), f"{s[name]['median_us'] - s['off']['median_us']:+.0f} µs"])
    rep.table(["variant", "n", "median", "p99", "vs off"], rows)
    rep.say()
    rep.say("idle echo worker (no tool has run)")
    rep.table(["daemon", "PSS", "USS"], [["sandbox on", c.fmt_bytes(pss_on), c.fmt_bytes(uss_on)],
                                         ["sandbox off", c.fmt_bytes(pss_off), c.fmt_bytes(uss_off)]])
    rep.say()
    create_delta_ms = (s["create-on"]["median_us"] - s["create-off"]["median_us"]) / 1000
    rep.goal("create_overhead_ms", create_delta_ms, 2.0, f"create +{create_delta_ms:.2f} ms (goal <= +2 ms)")
    for name in ("landlock", "namespaces"):
        delta = (s[name]["median_us"] - s["off"]["median_us"]) / 1000
        rep.goal(f"tool_call_overhead_ms_{name}", delta, 5.0,
                 f"tool call with {name} +{delta:.2f} ms (goal <= +5 ms)")
    rep.goal("idle_pss_ratio", pss_on / pss_off, 1.10, f"idle PSS on/off {pss_on / pss_off:.2f}x (goal <= 1.10x)")
    rep.figures.update({k: v for k, v in s.items()})
    rep.figures.update({"idle_pss_on": pss_on, "idle_pss_off": pss_off, "idle_uss_on": uss_on,
                        "idle_uss_off": uss_off})
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
