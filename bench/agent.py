"""What the daemon and worker add to a streamed LLM reply.

    .venv/bin/python bench/agent.py [--n 20] [--tokens 2000] [--json]

One FakeLLM (tests/fakellm.py: a scripted OpenAI-compatible server, stdlib
ThreadingHTTPServer) runs in a process of its own, so that it shares no GIL
with the bench client, with TCP_NODELAY on its sockets (see _SERVER); every measured request gets the same stream: a role
chunk, `--tokens` chunks of one short token each (" t0", " t1", ...), a
finish chunk, `[DONE]`.  Three clients read that stream, in rotating order
within each round:

* daemon: `AsyncClient.send` to a session of the `agent` handler configured
  against the FakeLLM (`[provider] base_url/model`, `[tools] enabled = []`).
  Each round uses a fresh session that has already made one short LLM call
  (so its worker has imported everything and holds a kept-alive connection,
  like the direct client), and deletes it afterwards; its history is one
  short exchange.  Path: input fsync'd, worker streams over httpx, parses
  SSE + JSON, one `Delta` frame per network read (the text already in
  hand) to the daemon, one `TextDelta` frame per `Delta` to the client.
* direct: an `httpx.AsyncClient` in this process (kept-alive connection)
  that POSTs the same kind of request, parses the SSE lines and the JSON of
  each chunk and takes `delta.content`: what a program talking to the LLM
  itself would do.
* raw: the same request, body read with `aiter_raw()` and tokens only
  counted by a byte search: the ceiling the FakeLLM itself allows on this
  machine (if direct ~= raw, the server is the bottleneck).

Time to first token: from just before the request (or `send`) to the first
non-empty token.  Tokens/s: (tokens - 1) / (last token - first token).
Medians over `--n` rounds after `--warmup`.  CPU per token of each process
(psutil, user + sys, summed over the timed rounds) shows where the time goes.

Goals: first-token overhead (daemon median - direct median) <= 2 ms;
daemon throughput >= 90% of the direct client's.
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]
sys.path.insert(0, str(_BENCH.parent))

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

from bench import _common as c  # noqa: E402

c.setup_path()

import httpx  # noqa: E402
import psutil  # noqa: E402

from ipc import messages as m  # noqa: E402
from supervisor.client import AsyncClient  # noqa: E402

TESTS = c.REPO / "tests"
MODEL = "fake-model"
SYSTEM = "You are a helpful assistant working inside a sandboxed workspace."  # the agent's default
PROMPT = "Count for me."

CONFIG = """
[provider]
base_url = "{url}"
model = "{model}"

[tools]
enabled = []

[agent.limits]
max_concurrent_sessions = 100
"""

# Runs in its own process: the FakeLLM with `rounds` x [short, long, long,
# long] scripted; prints its base URL, serves until stdin closes.  Its
# sockets get TCP_NODELAY, as real servers (uvicorn, llama.cpp) set it:
# without it, a small chunk written while the previous one is unacknowledged
# waits for the reader's delayed ACK (up to 40 ms), which hits whichever
# client happens to ACK late, not the code under test.
_SERVER = r"""
import socket, sys
import fakellm
from fakellm import FakeLLM, text_stream
_setup = fakellm._Handler.setup
def setup(self):
    _setup(self)
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
fakellm._Handler.setup = setup
tokens, rounds = int(sys.argv[1]), int(sys.argv[2])
long = text_stream(*[f" t{i}" for i in range(tokens)])
short = text_stream("ok")
llm = FakeLLM().start()
llm.script(*([short, long, long, long] * rounds))
print(llm.base_url, flush=True)
sys.stdin.read()
llm.stop()
"""


class LLMServer:
    def __init__(self, tokens: int, rounds: int) -> None:
        env = c.child_env()
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(tokens), str(rounds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        c.on_exit(self.stop)
        assert self.proc.stdout is not None
        self.base_url = self.proc.stdout.readline().decode().strip()
        if not self.base_url.startswith("http"):
            self.stop()
            raise RuntimeError("the FakeLLM process did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(3)


def request_body() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_direct(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    t0 = time.perf_counter_ns()
    first = last = 0
    n = 0
    async with http.stream("POST", url, json=request_body()) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue  # the body ends right after; reading it keeps the connection
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if content:
                now = time.perf_counter_ns()
                if not first:
                    first = now
                last = now
                n += 1
    return {"ttft": first - t0, "span": last - first, "tokens": n}


async def run_raw(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    marker = b'"content": " '
    t0 = time.perf_counter_ns()
    first = last = 0
    n = 0
    async with http.stream("POST", url, json=request_body()) as resp:
        resp.raise_for_status()
        tail = b""
        async for data in resp.aiter_raw():
            buf = tail + data  # a marker may straddle two reads
            tail = buf[-(len(marker) - 1):]
            k = buf.count(marker)
            if k:
                now = time.perf_counter_ns()
                if not first:
                    first = now
                last = now
                n += k
    return {"ttft": first - t0, "span": last - first, "tokens": n}


async def run_daemon(client: AsyncClient, sid: str) -> dict[str, int]:
    t0 = time.perf_counter_ns()
    first = last = 0
    n = 0
    async for ev in client.send(sid, PROMPT):
        if isinstance(ev, m.TextDelta):
            now = time.perf_counter_ns()
            if not first:
                first = now
            last = now
            # A delta carries whatever text the worker had in hand: count
            # the tokens in it, not the frames.
            n += ev.text.count(" t")
        elif isinstance(ev, m.TurnFailed):
            raise RuntimeError(f"the agent turn failed: {ev.reason}")
    return {"ttft": first - t0, "span": last - first, "tokens": n}


def cpu_of(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            t = proc.cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--tokens", type=int, default=2000, help="chunks per stream (default 2000)")
    args = p.parse_args()
    rep = c.Report("agent", args.json)

    rounds = args.warmup + args.n
    server = LLMServer(args.tokens, rounds)
    daemon = c.BenchDaemon(CONFIG.format(url=server.base_url, model=MODEL), tag="sdb-agt")
    results: dict[str, list[dict[str, int]]] = defaultdict(list)
    cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    url = server.base_url.rstrip("/") + "/chat/completions"

    async def run() -> None:
        client = await AsyncClient.connect(daemon.socket, client_name="bench-agent")
        http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False,
                                 headers={"Accept": "text/event-stream"})
        me = psutil.Process()
        fake = psutil.Process(server.proc.pid)
        dproc = psutil.Process(daemon.pid)
        try:
            for r in range(rounds):
                info = await client.create(handler="agent")
                sid = info.id
                await client.send_text(sid, "warm up")  # the round's "short" response
                daemon.remember()
                worker = psutil.Process((await client.status(sid)).pid)
                procs = {"client (this)": me, "daemon": dproc, "worker": worker, "fakellm": fake}
                order = ["daemon", "direct", "raw"]
                k = r % 3
                order = order[k:] + order[:k]
                if r == rounds - args.n:
                    c.quiet_gc()
                for kind in order:
                    before = cpu_of(procs)
                    if kind == "daemon":
                        res = await run_daemon(client, sid)
                    elif kind == "direct":
                        res = await run_direct(http, url)
                    else:
                        res = await run_raw(http, url)
                    after = cpu_of(procs)
                    if res["tokens"] != args.tokens:
                        raise RuntimeError(f"{kind}: {res['tokens']} tokens, expected {args.tokens}")
                    if r >= args.warmup:
                        results[kind].append(res)
                        for name in procs:
                            cpu[kind][name] += after[name] - before[name]
                await client.remove(sid)
        finally:
            await http.aclose()
            await client.close()

    try:
        daemon.start()
        asyncio.run(run())
    finally:
        daemon.cleanup()
        server.stop()

    figs: dict[str, Any] = {}
    rows = []
    for kind in ("daemon", "direct", "raw"):
        ttft = c.summarize([x["ttft"] for x in results[kind]])
        rates = sorted((x["tokens"] - 1) / (x["span"] / 1e9) for x in results[kind])
        rate_med = c.percentile(rates, 50)
        total_tokens = sum(x["tokens"] for x in results[kind])
        per_tok = {name: secs / total_tokens * 1e6 for name, secs in cpu[kind].items()}
        figs[kind] = {"ttft": ttft, "tokens_per_s_median": rate_med, "tokens_per_s_min": rates[0],
                      "cpu_us_per_token": per_tok}
        rows.append([kind, str(int(ttft["n"])), c.fmt_us(ttft["median_us"]), c.fmt_us(ttft["p99_us"]),
                     f"{rate_med:,.0f}", f"{rates[0]:,.0f}",
                     *(f"{per_tok.get(name, 0.0):.1f}" for name in ("client (this)", "daemon", "worker",
                                                                    "fakellm"))])
    overhead = figs["daemon"]["ttft"]["median_us"] - figs["direct"]["ttft"]["median_us"]
    ratio = figs["daemon"]["tokens_per_s_median"] / figs["direct"]["tokens_per_s_median"]
    server_bound = figs["direct"]["tokens_per_s_median"] / figs["raw"]["tokens_per_s_median"]
    figs["ttft_overhead_us"] = overhead
    figs["throughput_ratio"] = ratio
    figs["direct_over_raw"] = server_bound
    rep.figures = figs
    rep.say(f"agent: {args.tokens} one-token chunks per stream from a FakeLLM process, "
            f"{args.n} rounds (daemon / direct / raw in rotating order), {os.cpu_count()} CPUs")
    rep.table(["client", "n", "TTFT med", "TTFT p99", "tok/s med", "tok/s min",
               "CPU µs/tok: client", "daemon", "worker", "fakellm"], rows)
    rep.say(f"  direct reaches {server_bound * 100:.0f}% of the raw read rate"
            + (" (the FakeLLM is the bottleneck of the direct client)" if server_bound > 0.9 else ""))
    rep.goal("first-token overhead <= 2 ms (median)", overhead / 1000, 2.0, f"{overhead / 1000:.2f} ms")
    rep.goal("daemon throughput >= 90% of direct", ratio * 100, 90.0, f"{ratio * 100:.0f}%",
             higher_is_better=True)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
