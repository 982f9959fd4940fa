"""Durable steps: what journaling each step costs a turn; how soon a turn resumes; tools at once.

    .venv/bin/python bench/steps.py [--n 20] [--tools 10] [--resumes 15] [--nap-ms 100] [--json]

One daemon (run under bench/_fsync_counter.py, which counts every fsync and
fdatasync of the daemon's process) and one FakeLLM (tests/fakellm.py) on
loopback in this process, whose answer follows from the conversation: with
t tool results so far it calls `write_file` (t < --tools), else answers
"done".  `write_file` runs in the worker (no sandbox start, no process): the
fastest tool that acts (a read-only tool, listed in `rerun_after_crash`,
does not wait for anything to be durable before it runs), so the steps'
share of the turn is the largest it can be.

Step cost: two agent sessions, one with steps on (the default,
`retry_aborted_turn = true`: each of the turn's 2 x tools + 1 steps is
journaled and waits for its fsync batch) and one with steps off
(`--set agent.worker.retry_aborted_turn=false`: nothing is journaled).
Each round sends one input to each, in alternating order (`send_text`, from
the send to the reply), and reads the fsync count before and after each
turn (one turn runs at a time, so the count is that turn's).  Figures:
median turn time each way and their ratio; fsyncs per turn each way, and
(on - off) / steps: the fsync batches a step costs.

Resume latency: per trial a fresh session with steps on gets an input
whose LLM request number `--tools // 2` hangs the first time; the bench
SIGKILLs the worker then and times from just before the kill to the
FakeLLM's receipt of that request again (the resumed turn has replayed its
journaled steps and made the one in flight again).  Baseline, in the same
trial once that turn is done: SIGKILL the same session's idle worker and
time to its `StateChanged{new="idle"}` (the restart alone, as
bench/restart.py).  Restart backoff is 1 ms (as bench/restart.py).

Tool calls at once: per round, each of two sessions gets an input whose
first response asks for three calls of `nap` (bench/bench_handlers.py: a
custom tool that sleeps --nap-ms, 100), then "done".  One session runs them
at once (`[tools] parallel = ["nap"]`), the other one by one (`--set
tools.parallel=[]`); steps on for both; alternating order, `send_text` from
the send to the reply.  Figures: median turn time each way, their
difference and ratio; fsyncs per turn each way.

Goals: steps on cost <= 5% of the turn's time and <= 1 fsync batch per step;
resume latency median <= restart median + 20 ms; three --nap-ms tools at
once take <= one of them + 50% (the turn's two LLM calls and steps included).
"""

from __future__ import annotations

import _path  # (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import collections
import os
import signal
import statistics
import threading
import time
from typing import Any

from bench import _common as c

sys.path.insert(0, str(c.REPO / "tests"))

from fakellm import Delay, FakeLLM, Hang, Response, Stream, text_stream, tool_call_stream
from ipc import messages as m
from supervisor.ctl.client import AsyncClient

CONFIG = """
[agent]
handler = "agent"
max_turns = 100
[agent.limits]
max_concurrent_sessions = 100
[agent.worker]
max_restart_attempts = 1000000
restart_window_secs = 1.0
restart_backoff_initial_ms = 1
restart_backoff_max_ms = 1
[provider]
base_url = "{url}"
model = "fake-model"
[tools]
enabled = ["write_file"]
custom = ["bench.bench_handlers:nap"]
parallel = ["nap"]
"""


class Model:
    """The FakeLLM's answers, and when each request came (by input, t)."""

    def __init__(self, tools: int, hold_at: int) -> None:
        self.tools, self.hold_at = tools, hold_at
        self.delay_secs = 0.0  # before each answer: the model's time to its first token
        self.nap_ms = 100
        self.stamps: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, request: dict[str, Any]) -> Response:
        now = time.perf_counter_ns()
        messages = request["messages"]
        user = next(msg["content"] for msg in reversed(messages) if msg["role"] == "user")
        last_user = max(i for i, msg in enumerate(messages) if msg["role"] == "user")
        t = sum(1 for msg in messages[last_user:] if msg["role"] == "tool")
        with self.lock:
            seen = self.stamps[(user, t)]
            seen.append(now)
            first = len(seen) == 1
        if user.startswith("hold") and t == self.hold_at and first:
            return Stream([Hang()])
        if user.startswith("nap"):
            return (tool_call_stream(*[(f"n{i}", "nap", {"ms": self.nap_ms}) for i in range(3)])
                    if t == 0 else text_stream("done"))
        answer = (tool_call_stream((f"c{t}", "write_file", {"path": "notes.txt", "content": f"{t}"}))
                  if t < self.tools else text_stream("done"))
        if self.delay_secs:
            answer.events = [Delay(self.delay_secs), *answer.events]
        return answer


def fsyncs(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


async def rounds(client: AsyncClient, args: Any, count: Path, sessions: list[tuple[str, str]],
                 text: str) -> dict[str, list[float]]:
    """Turns on each of `sessions` (mode, id) per round, in alternating
    order: send -> reply times and fsyncs per turn, by mode; then removed."""
    out: dict[str, list[float]] = {f"{mode}_{what}": [] for mode, _ in sessions for what in ("ms", "fsyncs")}
    for r in range(args.warmup + args.n):
        for mode, sid in sessions if r % 2 == 0 else reversed(sessions):
            before = fsyncs(count)
            t0 = time.perf_counter_ns()
            reply = await client.send_text(sid, f"{text} {r} {mode}")
            dt = time.perf_counter_ns() - t0
            assert reply == "done", reply
            if r >= args.warmup:
                out[f"{mode}_ms"].append(dt / 1e6)
                out[f"{mode}_fsyncs"].append(fsyncs(count) - before)
    for _, sid in sessions:
        await client.remove(sid)
    return out


async def cost_rounds(client: AsyncClient, args: Any, count: Path, model: Model,
                      delay_ms: float) -> dict[str, list[float]]:
    model.delay_secs = delay_ms / 1000
    on = (await client.create()).id
    off = (await client.create(settings={"agent.worker.retry_aborted_turn": False})).id
    out = await rounds(client, args, count, [("on", on), ("off", off)], f"round {delay_ms}")
    model.delay_secs = 0.0
    return out


async def parallel_rounds(client: AsyncClient, args: Any, count: Path, model: Model) -> dict[str, list[float]]:
    model.nap_ms = args.nap_ms
    at_once = (await client.create()).id
    one_by_one = (await client.create(settings={"tools.parallel": []})).id
    return await rounds(client, args, count, [("at_once", at_once), ("one_by_one", one_by_one)], "nap")


async def resume_trials(client: AsyncClient, args: Any, model: Model) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"resume_ms": [], "restart_ms": []}
    for r in range(args.warmup + args.resumes):
        sid = (await client.create()).id
        events: asyncio.Queue[tuple[int, m.Event]] = asyncio.Queue()

        async def watch() -> None:
            async for ev in client.attach(sid):
                events.put_nowait((time.perf_counter_ns(), ev))

        watcher = asyncio.create_task(watch())
        text = f"hold {r}"
        turn = asyncio.create_task(client.send_text(sid, text))
        key = (text, model.hold_at)
        while not model.stamps.get(key):
            await asyncio.sleep(0.0005)
        pid = (await client.status(sid)).pid
        assert pid
        t0 = time.perf_counter_ns()
        os.kill(pid, signal.SIGKILL)
        while len(model.stamps[key]) < 2:
            await asyncio.sleep(0.0002)
        resume = model.stamps[key][1] - t0
        got = await turn
        assert got.endswith("done"), got
        while not events.empty():
            events.get_nowait()
        pid = (await client.status(sid)).pid
        assert pid
        t0 = time.perf_counter_ns()
        os.kill(pid, signal.SIGKILL)
        while True:
            at, ev = await asyncio.wait_for(events.get(), 10)
            if isinstance(ev, m.StateChanged) and ev.new == "idle" and ev.old == "starting":
                break
        restart = at - t0
        watcher.cancel()
        await client.remove(sid)
        if r >= args.warmup:
            out["resume_ms"].append(resume / 1e6)
            out["restart_ms"].append(restart / 1e6)
    return out


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20, help="timed turns each way (default 20)")
    p.add_argument("--tools", type=int, default=10, help="tool calls per turn (default 10)")
    p.add_argument("--model-ms", type=float, default=10.0,
                   help="the fast model: ms before each answer (default 10); 0 is also measured")
    p.add_argument("--resumes", type=int, default=15, help="timed resumes (default 15)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--nap-ms", type=int, default=100, help="each of the three tools at once: ms (default 100)")
    args = p.parse_args()
    rep = c.Report("steps", args.json)
    model = Model(args.tools, args.tools // 2)
    llm = FakeLLM().start()
    c.on_exit(llm.stop)
    llm.respond = model
    daemon = c.BenchDaemon(CONFIG.format(url=llm.base_url), launcher=_path.BENCH / "_fsync_counter.py",
                           tag="sdb-steps")
    count = daemon.dir / "fsyncs"
    daemon.env["SESSIOND_path.BENCH_FSYNC_COUNT"] = str(count)
    daemon.start()
    delays = [0.0, args.model_ms] if args.model_ms else [0.0]

    async def run() -> tuple[list[dict[str, list[float]]], dict[str, list[float]], dict[str, list[float]]]:
        client = await AsyncClient.connect(daemon.socket, client_name="bench-steps")
        try:
            c.quiet_gc()
            costs = [await cost_rounds(client, args, count, model, d) for d in delays]
            resume = await resume_trials(client, args, model)
            return costs, resume, await parallel_rounds(client, args, count, model)
        finally:
            await client.close()

    load_before = os.getloadavg()
    costs, resume, parallel = asyncio.run(run())
    load_after = os.getloadavg()
    steps = 2 * args.tools + 1
    rep.say(f"an agent turn of {args.tools} write_file calls ({steps} steps), {args.n} turns each way")
    rows = []
    shares: list[tuple[float, float, float]] = []
    for d, cost in zip(delays, costs):
        med = {k: statistics.median(v) for k, v in cost.items()}
        share = (med["on_ms"] - med["off_ms"]) / med["off_ms"]
        per_step = (med["on_fsyncs"] - med["off_fsyncs"]) / steps
        shares.append((d, share, per_step))
        label = "instant model" if not d else f"model answers in {d:g} ms"
        rows.append([label, f"{med['on_ms']:.2f} ms", f"{med['off_ms']:.2f} ms", f"{share * 100:+.1f}%",
                     f"{med['on_fsyncs']:.0f} / {med['off_fsyncs']:.0f}", f"{per_step:.2f}"])
        rep.figures[f"model_{d:g}ms"] = {k: round(v, 3) for k, v in med.items()} | {"share": round(share, 4)}
    rep.table(["", "steps on", "steps off", "cost", "fsyncs/turn on / off", "fsync batches/step"], rows)
    rep.say()
    rmed = {k: statistics.median(v) for k, v in resume.items()}
    rep.say(f"{args.resumes} resumes (kill during LLM call {args.tools // 2 + 1}, "
            f"{2 * (args.tools // 2)} steps journaled)")
    rep.table(["", "median", "p90"], [
        ["kill -> resumed turn's next LLM request", f"{rmed['resume_ms']:.2f} ms",
         f"{c.percentile(sorted(resume['resume_ms']), 90):.2f} ms"],
        ["kill -> idle (restart alone)", f"{rmed['restart_ms']:.2f} ms",
         f"{c.percentile(sorted(resume['restart_ms']), 90):.2f} ms"],
    ])
    rep.figures.update({k: round(v, 3) for k, v in rmed.items()})
    rep.say()
    pmed = {k: statistics.median(v) for k, v in parallel.items()}
    rep.say(f"a turn of three {args.nap_ms} ms tool calls in one response, {args.n} turns each way")
    rep.table(["", "median", "p90", "fsyncs/turn"], [
        ["at once ([tools] parallel)", f"{pmed['at_once_ms']:.1f} ms",
         f"{c.percentile(sorted(parallel['at_once_ms']), 90):.1f} ms", f"{pmed['at_once_fsyncs']:.0f}"],
        ["one by one", f"{pmed['one_by_one_ms']:.1f} ms",
         f"{c.percentile(sorted(parallel['one_by_one_ms']), 90):.1f} ms", f"{pmed['one_by_one_fsyncs']:.0f}"],
    ])
    saved = pmed["one_by_one_ms"] - pmed["at_once_ms"]
    rep.say(f"at once saves {saved:.1f} ms a turn ({pmed['one_by_one_ms'] / pmed['at_once_ms']:.2f}x faster)")
    rep.figures.update({k: round(v, 3) for k, v in pmed.items()})
    rep.say(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    rep.figures["loadavg"] = [round(load_before[0], 2), round(load_after[0], 2)]
    rep.say()
    d, share, per_step = shares[-1]
    rep.goal(f"step journaling cost <= 5% of the turn (model {d:g} ms)", share, 0.05, f"{share * 100:+.1f}%")
    rep.goal("fsync batches per step <= 1", per_step, 1.0, f"{per_step:.2f}")
    extra = rmed["resume_ms"] - rmed["restart_ms"]
    rep.goal("resume latency <= restart + 20 ms", extra, 20.0,
             f"{rmed['resume_ms']:.1f} ms vs restart {rmed['restart_ms']:.1f} ms (+{extra:.1f} ms)")
    over = pmed["at_once_ms"] / args.nap_ms - 1
    rep.goal(f"three {args.nap_ms} ms tools at once <= one + 50%", over, 0.5,
             f"{pmed['at_once_ms']:.1f} ms (one by one {pmed['one_by_one_ms']:.1f} ms)")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
