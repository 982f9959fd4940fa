"""Turns with OpenTelemetry tracing off vs on, side by side in one run; and
the daemon's memory over many turns while the collector is down.

    .venv/bin/python bench/tracing.py [--echo-turns 1500] [--agent-turns 150]
                                      [--memory-turns 100000] [--concurrency 8] [--json]

(a) Latency, three daemons with the same config: `off` (no [tracing]),
    `on` (`[tracing] exporter = "otlp"` to a real OTLP/HTTP receiver on
    loopback, tests/otlp_receiver.py, in a process of its own: it decodes
    every request with opentelemetry-proto and counts the spans), all
    three on one scripted LLM server (tests/fakellm.py, its own process).
    - echo: one echo turn (`send_text`) at a time, alternating off/on turn
      by turn (the order flips every round), --echo-turns each: medians.
    - agent: one agent turn at a time, alternating likewise, --agent-turns
      each: the model calls `list_dir`, then streams a 20-token answer
      (two LLM calls, one tool call: 4 worker spans and 4 daemon spans).
    The receiver's span count is checked against what the daemon made.
(b) Memory with the collector down: a third daemon traces to a port where
    nothing listens (connection refused: every export fails after its
    retries) and runs --memory-turns echo turns, --concurrency sessions at
    once; the `off` daemon runs as many beside it.  The daemons' RSS is
    sampled every tenth of the run; printed: the first sample after the
    warm-up, the last, the growth of each, and the tracer's counts
    (spans made, dropped, failed) from `sessionctl stats --json`.

The memory run's 100,000 turns per daemon, 8 at a time, take ~2 minutes
of the ~4 of the whole bench; --memory-turns makes it shorter.

The receiver stands for a collector on another machine: it runs at nice 19,
so that its decoding does not take the CPU from the turns it times.

Goals: echo turn median with tracing on <= 1.05x off; agent turn <= 1.03x;
the daemon's RSS growth past the first tenth with the collector down within
1 MiB of the growth of the daemon without tracing (which grows while its
sessions' retained events and logs fill up to their caps); the exporter
process's RSS is printed beside.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys

import asyncio
import contextlib
import os
import socket
import subprocess
import time

import psutil

from bench import _common as c

from supervisor.ctl.client import AsyncClient

TESTS = c.REPO / "tests"
TOKENS = 20

# The receiver and the LLM server each in a process of their own: as
# threads of this client they would take its GIL while it times turns.
_RECEIVER = r"""
import os, sys, time
from otlp_receiver import OtlpReceiver
os.nice(19)  # it stands for a collector on another machine: not a competitor of the turns
with OtlpReceiver(keep=False) as rx:
    print(rx.endpoint, flush=True)
    for line in sys.stdin:
        print(rx.count, flush=True)
"""

_LLM = r"""
import socket, sys
import fakellm
from fakellm import FakeLLM, text_stream, tool_call_stream
turns = int(sys.argv[1])
answer = text_stream(*[f" t{i}" for i in range(int(sys.argv[2]))])
call = tool_call_stream(("c1", "list_dir", {"path": "."}))
llm = FakeLLM().start()
llm.script(*([call, answer] * turns))
print(llm.base_url, flush=True)
sys.stdin.read()
llm.stop()
"""


class Helper:
    """A helper process that prints one line (its address) and then answers
    a line on stdin with a line on stdout."""

    def __init__(self, code: str, *args: str) -> None:
        env = c.child_env()
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
        self.proc = subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        c.on_exit(self.stop)
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        if not self.address.startswith("http"):
            raise RuntimeError("a bench helper process did not start")

    def ask(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(3)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 9)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(llm: str, tracing: str) -> str:
    return f"""
[agent]
handler = "echo"
[agent.limits]
max_concurrent_sessions = 200
[provider]
base_url = "{llm}"
model = "bench-model"
{tracing}
"""


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--echo-turns", type=int, default=1500, help="timed echo turns per daemon (default 1500)")
    p.add_argument("--agent-turns", type=int, default=150, help="timed agent turns per daemon (default 150)")
    p.add_argument("--warmup", type=int, default=30, help="untimed turns of each kind first (default 30)")
    p.add_argument("--memory-turns", type=int, default=100_000,
                   help="echo turns per daemon with the collector down (default 100000)")
    p.add_argument("--concurrency", type=int, default=8, help="memory run: sessions sending at once (default 8)")
    args = p.parse_args()
    rep = c.Report("tracing", args.json)

    receiver = Helper(_RECEIVER)
    llm = Helper(_LLM, str(2 * (args.agent_turns + args.warmup) + 4), str(TOKENS))
    # The exporter's batch delay as the SDK's default (5 s) would leave most
    # spans of a short run queued at its end: 200 ms, so the run exports.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "200"}
    daemons = {
        "off": c.BenchDaemon(config(llm.address, ""), tag="sdb-toff").start(),
        "on": c.BenchDaemon(config(llm.address, f'[tracing]\nexporter = "otlp"\nendpoint = "{receiver.address}"\n'),
                            tag="sdb-ton", env=env).start(),
    }
    down = c.BenchDaemon(config(llm.address, '[tracing]\nexporter = "otlp"\nendpoint = '
                                f'"http://127.0.0.1:{_closed_port()}/v1/traces"\n'), tag="sdb-tdown", env=env)
    latency: dict[str, dict[str, list[int]]] = {"echo": {"off": [], "on": []}, "agent": {"off": [], "on": []}}
    memory: dict[str, list[int]] = {"off": [], "down": [], "down's exporter": []}
    tracer_stats: dict[str, dict[str, object]] = {}

    cpu_us: dict[str, dict[str, float]] = {}

    def cpu_secs(proc: psutil.Process) -> float:
        t = proc.cpu_times()
        return float(t.user + t.system)

    async def timed(kind: str, turns: int, sids: dict[str, str], clients: dict[str, AsyncClient]) -> None:
        procs = {"daemon off": psutil.Process(daemons["off"].pid), "daemon on": psutil.Process(daemons["on"].pid)}
        procs.update({"exporter (on)": p for p in procs["daemon on"].children()
                      if "otel_export" in " ".join(p.cmdline())})
        procs["receiver"] = psutil.Process(receiver.proc.pid)
        before: dict[str, float] = {}
        for r in range(args.warmup + turns):
            if r == args.warmup:
                before = {k: cpu_secs(p) for k, p in procs.items()}
            for k in (("off", "on") if r % 2 == 0 else ("on", "off")):
                t0 = time.perf_counter_ns()
                await clients[k].send_text(sids[k], c.message(r, 100) if kind == "echo" else "look")
                if r >= args.warmup:
                    latency[kind][k].append(time.perf_counter_ns() - t0)
        cpu_us[kind] = {k: (cpu_secs(p) - before[k]) / turns * 1e6 for k, p in procs.items()}

    async def exporter_ready(client: AsyncClient) -> None:
        """The exporter process has imported OpenTelemetry (~0.5 s of CPU
        after the daemon's start, which would land on the first turns)."""
        deadline = time.monotonic() + 30
        while not (await client.stats()).tracing.get("ready") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def run_latency() -> None:
        clients = {k: await AsyncClient.connect(d.socket, client_name="bench-tracing") for k, d in daemons.items()}
        try:
            await exporter_ready(clients["on"])
            echo = {k: (await cl.create(handler="echo")).id for k, cl in clients.items()}
            agent = {k: (await cl.create(handler="agent")).id for k, cl in clients.items()}
            c.quiet_gc()
            await timed("echo", args.echo_turns, echo, clients)
            await timed("agent", args.agent_turns, agent, clients)
            tracer_stats["on"] = (await clients["on"].stats()).tracing
        finally:
            for cl in clients.values():
                await cl.close()

    async def run_memory() -> None:
        targets = {"off": daemons["off"], "down": down}
        clients = {k: await AsyncClient.connect(d.socket, client_name="bench-tracing") for k, d in targets.items()}
        procs = {k: psutil.Process(d.pid) for k, d in targets.items()}
        exporter = next(p for p in procs["down"].children() if "otel_export" in " ".join(p.cmdline()))
        try:
            await exporter_ready(clients["down"])
            sids = {k: [(await cl.create(handler="echo")).id for _ in range(args.concurrency)]
                    for k, cl in clients.items()}
            per_session = max(1, args.memory_turns // args.concurrency)
            step = max(1, per_session // 10)

            async def sender(k: str, i: int) -> None:
                for n in range(per_session):
                    await clients[k].send_text(sids[k][i], c.message(n, 100))
                    if i == 0 and n % step == step - 1:
                        memory[k].append(procs[k].memory_info().rss)
                        if k == "down":
                            memory["down's exporter"].append(exporter.memory_info().rss)

            for k in targets:
                await asyncio.gather(*(sender(k, i) for i in range(args.concurrency)))
            deadline = time.monotonic() + 10
            while (await clients["down"].stats()).tracing.get("in_transit") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            tracer_stats["down"] = (await clients["down"].stats()).tracing
        finally:
            for cl in clients.values():
                await cl.close()

    try:
        asyncio.run(run_latency())
        # What the receiver got, once the last batch had time to go.
        deadline = time.monotonic() + 10
        made = int(tracer_stats["on"].get("spans", 0))  # type: ignore[call-overload]
        received = int(receiver.ask())
        while received < made and time.monotonic() < deadline:
            time.sleep(0.2)
            received = int(receiver.ask())
        down.start()
        asyncio.run(run_memory())
    finally:
        for d in (*daemons.values(), down):
            d.cleanup()
        receiver.stop()
        llm.stop()

    lat = {kind: {k: c.summarize(v) for k, v in per.items()} for kind, per in latency.items()}
    ratios = {kind: lat[kind]["on"]["median_us"] / lat[kind]["off"]["median_us"] for kind in lat}
    rep.figures = {"latency": lat, "ratios": ratios, "cpu_us_per_turn": cpu_us, "tracer_on": tracer_stats.get("on", {}),
                   "received": received, "memory_rss": memory, "tracer_down": tracer_stats.get("down", {}),
                   "memory_turns": args.memory_turns}
    rep.say(f"tracing: turns with tracing off vs on (exporting to an OTLP/HTTP receiver on loopback), "
            "interleaved, one at a time")
    rep.table(
        ["", "off median", "on median", "on / off", "off p99", "on p99"],
        [[kind, c.fmt_us(lat[kind]["off"]["median_us"]), c.fmt_us(lat[kind]["on"]["median_us"]),
          f"{ratios[kind]:.3f}x", c.fmt_us(lat[kind]["off"]["p99_us"]), c.fmt_us(lat[kind]["on"]["p99_us"])]
         for kind in ("echo", "agent")],
    )
    rep.say("CPU per turn (user + system, over the timed turns):")
    names = list(cpu_us["echo"])
    rep.table(["", *names], [[kind, *(f"{cpu_us[kind][n]:.0f} µs" for n in names)] for kind in ("echo", "agent")])
    on = tracer_stats.get("on", {})
    rep.say(f"spans made {on.get('spans')}, received by the collector {received}, dropped {on.get('dropped')}")
    growth = {k: (v[-1] - v[0]) if len(v) >= 2 else 0 for k, v in memory.items()}
    rep.say(f"\nmemory: {args.memory_turns} echo turns per daemon ({args.concurrency} sessions at once), "
            "the collector down (nothing listens at its port) vs tracing off")
    rep.table(
        ["", "RSS after 1/10", "RSS at the end", "growth"],
        [[k, c.fmt_bytes(v[0]), c.fmt_bytes(v[-1]), c.fmt_bytes(growth[k])] for k, v in memory.items() if v],
    )
    dn = tracer_stats.get("down", {})
    rep.say(f"collector down: spans made {dn.get('spans')}, dropped {dn.get('dropped')}, failed {dn.get('failed')}, "
            f"queued {dn.get('queued')}, exporting {dn.get('exporting')}")
    rep.goal("echo turn median with tracing on within 5%", ratios["echo"], 1.05, f"{ratios['echo']:.3f}x")
    rep.goal("agent turn median with tracing on within 3%", ratios["agent"], 1.03, f"{ratios['agent']:.3f}x")
    extra = (growth["down"] - growth["off"]) / 1048576
    exporter_growth = growth["down's exporter"]
    rep.goal("daemon RSS growth with the collector down within 1 MiB of tracing off's", extra, 1.0,
             f"{c.fmt_bytes(growth['down'])} vs {c.fmt_bytes(growth['off'])} (the exporter process: "
             f"{c.fmt_bytes(exporter_growth)})")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
