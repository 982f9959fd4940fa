"""What the daemon and worker add to a streamed LLM reply.

    .venv/bin/python bench/agent.py [--n 20] [--tokens 2000] [--history-kb K]
                                    [--baseline DIR] [--probe [--profile FILE]] [--json]

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
  like the direct client), and deletes it afterwards; its history is that
  one exchange (`--history-kb` makes its input that many KiB).  Path: input fsync'd, worker streams over httpx, parses
  SSE + JSON, one `Delta` frame per network read (the text already in
  hand) to the daemon, one `TextDelta` frame per `Delta` to the client.
* base (`--baseline DIR`): the same through a daemon running another
  checkout's code (e.g. `git worktree add --detach /tmp/base main`), so a
  change is measured against the code before it in the same rounds; the
  median of the per-round differences is printed too.
* direct: an `httpx.AsyncClient` in this process (kept-alive connection)
  that POSTs the same request (the same history), parses the SSE lines and the JSON of
  each chunk and takes `delta.content`: what a program talking to the LLM
  itself would do.
* raw: the same request, body read with `aiter_raw()` and tokens only
  counted by a byte search: the ceiling the FakeLLM itself allows on this
  machine (if direct ~= raw, the server is the bottleneck).

Time to first token: from just before the request (or `send`) to the first
non-empty token.  Tokens/s: the tokens that arrived after the second
arrival (token or delta), over the time from it to the last.

`--gap-ms G`: the FakeLLM pauses G ms after the first token, as a real
model does between tokens (a 10-20 ms gap is 50-100 tokens/s).  Without
it every token comes at once, and the first token's hops through the
daemon and to this client wait for a CPU behind the worker and the FakeLLM
already busy with the rest of the stream (a firehose no model sends): the
direct client has no such hops.
Medians over `--n` rounds after `--warmup`.  CPU per token of each process
(psutil, user + sys, summed over the timed rounds) shows where the time goes.

`--probe`: where the first token's time goes.  The daemon's session runs
`bench._agent_probe:ProbedAgent` (the agent handler with timestamps at each
step in the worker), the daemon runs under `bench/_agent_probe.py` as its
launcher (stamps of the first delta's hop), the FakeLLM stamps each request
it serves, and this client stamps `Accepted` and the first `TextDelta` as
they arrive; all `perf_counter_ns` (CLOCK_MONOTONIC, one clock for every
process).  Prints the median of each stamp after the send.  `--profile
FILE` adds a cProfile (CPU time) of each worker from its input to its first
delta.  Probing costs a few µs per stamp: read its table for where the
time goes, and runs without it for the figures.

Goals: first-token overhead (daemon median - direct median) <= 2 ms;
daemon throughput >= 90% of the direct client's.
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
import tempfile
import time
from collections import defaultdict
from typing import Any

from bench import _common as c

import httpx
import psutil

from ipc import messages as m
from supervisor.ctl.client import AsyncClient

TESTS = c.REPO / "tests"
MODEL = "fake-model"
SYSTEM = "You are a helpful assistant working inside a sandboxed workspace."  # the agent's default
PROMPT = "Count for me."

# --probe: the agent handler with timestamps (bench/_agent_probe.py).
PROBE_CONFIG = """
[agent]
allowed_handlers = ["agent", "bench._agent_probe:*"]
"""

CONFIG = """
[provider]
base_url = "{url}"
model = "{model}"

[tools]
enabled = []

[agent.limits]
max_concurrent_sessions = 100
"""

# Runs in its own process: the FakeLLM with `rounds` x [`shorts` x short,
# `longs` x long] scripted (a warm-up per daemon, a measured stream per kind); prints its base URL, serves until stdin closes.  Its
# sockets get TCP_NODELAY, as real servers (uvicorn, llama.cpp) set it:
# without it, a small chunk written while the previous one is unacknowledged
# waits for the reader's delayed ACK (up to 40 ms), which hits whichever
# client happens to ACK late, not the code under test.
_SERVER = r"""
import json, socket, sys, time
import fakellm
from fakellm import FakeLLM, text_stream
_setup = fakellm._Handler.setup
def setup(self):
    _setup(self)
    self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
fakellm._Handler.setup = setup
tokens, rounds, shorts, longs, gap_us = map(int, sys.argv[1:6])
if len(sys.argv) > 6:  # --probe: this server's stamps of each request, one JSON line each
    probe = open(sys.argv[6], "a", buffering=1)
    ns = time.perf_counter_ns
    H = fakellm._Handler
    _parse, _post, _chunk = H.parse_request, H.do_POST, H._chunk
    def parse_request(self):
        self.stamps = {"line": ns()}  # the request line is read
        return _parse(self)
    def do_POST(self):
        self.stamps["headers"] = ns()  # headers parsed
        self.chunks = 0
        _post(self)
        probe.write(json.dumps(self.stamps) + "\n")
    def chunk(self, data):
        self.chunks += 1
        if self.chunks == 2:  # the role chunk is the first
            self.stamps["content"] = ns()
        _chunk(self, data)
    H.parse_request, H.do_POST, H._chunk = parse_request, do_POST, chunk
long = text_stream(*[f" t{i}" for i in range(tokens)])
if gap_us:  # --gap-ms: a pause after the first token, as a model's next token takes
    long.events.insert(2, fakellm.Delay(gap_us / 1e6))
short = text_stream("ok")
llm = FakeLLM().start()
llm.script(*(([short] * shorts + [long] * longs) * rounds))
print(llm.base_url, flush=True)
sys.stdin.read()
llm.stop()
"""


class LLMServer:
    def __init__(self, tokens: int, rounds: int, shorts: int, longs: int, gap_ms: float = 0.0,
                 probe: Path | None = None) -> None:
        env = c.child_env()
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *map(str, (tokens, rounds, shorts, longs, round(gap_ms * 1000))),
             *([str(probe)] if probe else [])],
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


def warm_up_text(history_kb: int) -> str:
    """The round's first input: a short one, or `history_kb` KiB of text."""
    if not history_kb:
        return "warm up"
    line = "warm up: a line of earlier work the model must keep in its context.\n"
    return (line * (history_kb * 1024 // len(line) + 1))[: history_kb * 1024]


def request_body(warm_text: str) -> dict[str, Any]:
    """What the agent sends for the measured input: the same history."""
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": warm_text},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": PROMPT},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Arrivals:
    """When the tokens of one stream arrived: the first token (time to
    first token), and the rate after the second arrival (tokens/s: a
    `--gap-ms` pause after the first token is not in it)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter_ns()
        self.first = self.second = self.last = 0
        self.n = self.counted = 0
        self.sched = sched_snap()

    def got(self, tokens: int) -> None:
        now = time.perf_counter_ns()
        if not self.first:
            self.first = now
            sched_since(self.sched)
        elif not self.second:
            self.second = now
        else:
            self.counted += tokens
        self.last = now
        self.n += tokens

    def result(self, **extra: int) -> dict[str, int]:
        return {"ttft": self.first - self.t0, "span": self.last - self.second, "tokens": self.n,
                "counted": self.counted, "t0": self.t0, "first": self.first,
                "end": time.perf_counter_ns(), **_probe, **extra}


async def run_direct(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, int]:
    _probe.clear()
    arr = Arrivals()
    async with http.stream("POST", url, json=body) as resp:
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
                arr.got(1)
    return arr.result()


async def run_raw(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, int]:
    marker = b'"content": " '
    _probe.clear()
    arr = Arrivals()
    async with http.stream("POST", url, json=body) as resp:
        resp.raise_for_status()
        tail = b""
        async for data in resp.aiter_raw():
            buf = tail + data  # a marker may straddle two reads
            tail = buf[-(len(marker) - 1):]
            k = buf.count(marker)
            if k:
                arr.got(k)
    return arr.result()


async def run_daemon(client: AsyncClient, sid: str) -> dict[str, int]:
    _probe.clear()
    arr = Arrivals()
    worker: dict[str, int] = {}
    async for ev in client.send(sid, PROMPT):
        if isinstance(ev, m.TextDelta):
            # A delta carries whatever text the worker had in hand: count
            # the tokens in it, not the frames.
            arr.got(ev.text.count(" t"))
        elif isinstance(ev, m.TurnFailed):
            raise RuntimeError(f"the agent turn failed: {ev.reason}")
        elif isinstance(ev, m.Notice) and ev.kind == "probe":
            worker = {f"w_{k}": int(v) for k, v in ev.data.items()}
    return arr.result(**worker)


# --probe: client-side stamps of the run in progress (the first of each kind).
_probe: dict[str, int] = {}
# --probe: the processes of the path whose scheduling is read (name -> pid).
_sched_pids: dict[str, int] = {}


def sched_snap() -> dict[str, tuple[int, int]]:
    return {name: c.sched_ns(pid) for name, pid in _sched_pids.items()}


def sched_since(before: dict[str, tuple[int, int]]) -> None:
    """Each process's CPU time (`r_NAME`) and run-queue wait (`q_NAME`:
    runnable, no CPU free) from the send to the first token, read once the
    token is in hand."""
    for name, (run0, wait0) in before.items():
        run1, wait1 = c.sched_ns(_sched_pids[name])
        _probe[f"r_{name}"] = run1 - run0
        _probe[f"q_{name}"] = wait1 - wait0


def _stamp(name: str) -> None:
    if name not in _probe:
        _probe[name] = time.perf_counter_ns()


def probe_client(client: AsyncClient) -> None:
    """Stamp the arrival of `Accepted` and of the first `TextDelta` frame
    (the client's `send` yields nothing before `Accepted`: a delta that
    came first waits in its queue)."""
    dispatch = client._dispatch

    def timed(msg: Any) -> None:
        if isinstance(msg, m.Accepted):
            _stamp("c_accepted")
        elif isinstance(msg, m.TextDelta):
            _stamp("c_delta")
        dispatch(msg)

    client._dispatch = timed  # type: ignore[method-assign]


async def _on_request(_: httpx.Request) -> None:
    _stamp("h_request")


async def _on_response(_: httpx.Response) -> None:
    _stamp("h_response")


# Each stamp of the probe table: (key, what it is), in path order.
_STEPS = [
    ("c_accepted", "client: Accepted arrives"),
    ("w_input", "worker: Input decoded"),
    ("w_handle", "worker: handle() entered"),
    ("w_request", "worker: httpx writes the request"),
    ("h_request", "direct: httpx writes the request"),
    ("s_line", "server: request line read"),
    ("s_headers", "server: headers parsed"),
    ("s_content", "server: first content chunk written"),
    ("w_response", "worker: response headers read"),
    ("h_response", "direct: response headers read"),
    ("w_read", "worker: first body bytes parsed"),
    ("w_emit", "worker: first text to ctx.emit"),
    ("w_write", "worker: its Delta frame written"),
    ("d_read", "daemon: reads it"),
    ("d_handled", "daemon: TextDelta queued"),
    ("d_written", "daemon: TextDelta written"),
    ("c_delta", "client: first TextDelta arrives"),
    ("first", "client: first token in hand"),
]


def probe_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="sdb-agt-probe-", suffix=".jsonl")
    os.close(fd)
    path = Path(name)
    c.on_exit(lambda: path.unlink(missing_ok=True))
    return path


def attach_stamps(runs: list[dict[str, int]], path: Path, key: str, prefix: str) -> None:
    """Give each run the stamps (the FakeLLM's of a request, the daemon's of
    a first delta) whose `key` stamp falls within it."""
    stamps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for run in runs:
        for st in stamps:
            if run["t0"] <= st[key] <= run["end"]:
                run.update({f"{prefix}{k}": v for k, v in st.items()})
                break


def merge_profiles(rep: c.Report, path: str) -> None:
    """The workers' profiles (one file each) merged into `path`; prints the top."""
    import glob
    import io
    import pstats

    parts = sorted(glob.glob(glob.escape(path) + ".*"))
    if not parts:
        rep.say(f"no worker profile found at {path}.*")
        return
    stats = pstats.Stats(parts[0])
    for part in parts[1:]:
        stats.add(part)
    stats.dump_stats(path)
    for part in parts:
        os.unlink(part)
    out = io.StringIO()
    pstats.Stats(path, stream=out).sort_stats("cumulative").print_stats(30)
    rep.say(f"worker profile, Input to first delta ({len(parts)} workers), saved to {path}:")
    rep.say(out.getvalue())


def probe_table(rep: c.Report, results: dict[str, list[dict[str, int]]]) -> dict[str, Any]:
    """Median time of each stamp after the send (ms), per client kind."""
    out: dict[str, dict[str, float]] = {}
    rows = []
    for key, label in _STEPS:
        cells = []
        for kind in ("daemon", "direct"):
            offsets = sorted((r[key] - r["t0"]) / 1e6 for r in results[kind] if key in r)
            if offsets:
                med = c.percentile(offsets, 50)
                out.setdefault(kind, {})[key] = med
                cells.append(f"{med:.2f}")
            else:
                cells.append("")
        if any(cells):
            rows.append([label, *cells])
    rep.say("where the first token's time goes (median ms after the send / request):")
    rep.table(["stamp", "daemon", "direct"], rows)
    rows = []
    for name in ("client", "daemon", "worker", "fakellm"):
        cells = []
        for kind in ("daemon", "direct"):
            for prefix in ("r_", "q_"):
                vals = sorted(r[prefix + name] / 1e6 for r in results[kind] if prefix + name in r)
                med = c.percentile(vals, 50) if vals else 0.0
                out.setdefault(kind, {})[prefix + name] = med
                cells.append(f"{med:.2f}")
        rows.append([name, *cells])
    for kind in ("daemon", "direct"):
        for prefix in ("r_", "q_"):
            keys = [prefix + n for n in ("client", "daemon", "worker", "fakellm")]
            sums = sorted(sum(r.get(k, 0) for k in keys) / 1e6 for r in results[kind])
            out[kind][prefix + "all"] = c.percentile(sums, 50)
    rows.append(["all (median of sums)", f"{out['daemon']['r_all']:.2f}", f"{out['daemon']['q_all']:.2f}",
                 f"{out['direct']['r_all']:.2f}", f"{out['direct']['q_all']:.2f}"])
    rep.say("send to first token, per process (median ms; /proc/PID/task/*/schedstat): on a CPU, "
            "and runnable waiting for one")
    rep.table(["process", "daemon: CPU", "daemon: run-queue", "direct: CPU", "direct: run-queue"], rows)
    return out


def cpu_of(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            t = proc.cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


class Build:
    """A daemon under test: this checkout's, or `--baseline`'s (another
    checkout of sessiond, e.g. a `git worktree` of the commit before), run
    with this venv and the same config."""

    def __init__(self, kind: str, repo: str | None, config: str, env: dict[str, str],
                 launcher: Path | None = None) -> None:
        self.kind = kind
        extra = dict(env)
        if repo is not None:
            extra["PYTHONPATH"] = str(Path(repo).resolve())
        self.daemon = c.BenchDaemon(config, tag="sdb-agt", env=extra, launcher=launcher)
        self.client: AsyncClient | None = None
        self.sid = ""


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--tokens", type=int, default=2000, help="chunks per stream (default 2000)")
    p.add_argument("--history-kb", type=int, default=0,
                   help="KiB of text in the warm-up input, so every measured request carries "
                        "that much history (the direct client's too; default 0)")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="the FakeLLM pauses this long after the first token (default 0: every "
                        "token at once); see the module docstring")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run another checkout's daemon (e.g. `git worktree add --detach "
                        "/tmp/base main`) in the same rounds, as client kind `base`")
    p.add_argument("--probe", action="store_true",
                   help="also stamp each step of the first token in client, worker and server "
                        "(bench/_agent_probe.py) and print where the time goes")
    p.add_argument("--profile", metavar="FILE",
                   help="with --probe: cProfile each worker from Input to its first delta, "
                        "stats merged into FILE (pstats format)")
    args = p.parse_args()
    rep = c.Report("agent", args.json)

    rounds = args.warmup + args.n
    warm_text = warm_up_text(args.history_kb)
    handler = "agent"
    probe_file: Path | None = None
    daemon_probe: Path | None = None
    env: dict[str, str] = {}
    if args.probe:
        handler = "bench._agent_probe:ProbedAgent"
        probe_file, daemon_probe = probe_path(), probe_path()
        env["SESSIOND_path.BENCH_AGENT_PROBE_DAEMON"] = str(daemon_probe)
        if args.profile:
            env["SESSIOND_path.BENCH_AGENT_PROFILE"] = args.profile
    kinds = ["daemon", *(["base"] if args.baseline else []), "direct", "raw"]
    builds_n = 2 if args.baseline else 1
    server = LLMServer(args.tokens, rounds, builds_n, len(kinds), args.gap_ms, probe_file)
    config = CONFIG.format(url=server.base_url, model=MODEL)
    builds = [Build("daemon", None, (PROBE_CONFIG if args.probe else "") + config, env,
                    c.BENCH / "_agent_probe.py" if args.probe else None)]
    if args.baseline:
        builds.append(Build("base", args.baseline, config, {}))
    results: dict[str, list[dict[str, int]]] = defaultdict(list)
    cpu: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    url = server.base_url.rstrip("/") + "/chat/completions"
    body = request_body(warm_text)

    async def run() -> None:
        for b in builds:
            b.client = await AsyncClient.connect(b.daemon.socket, client_name="bench-agent")
            if args.probe and b.kind == "daemon":
                probe_client(b.client)
        http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), trust_env=False,
                                 headers={"Accept": "text/event-stream"})
        if args.probe:
            http.event_hooks = {"request": [_on_request], "response": [_on_response]}
        me = psutil.Process()
        fake = psutil.Process(server.proc.pid)
        try:
            for r in range(rounds):
                procs = {"client (this)": me, "fakellm": fake}
                for b in builds:
                    assert b.client is not None
                    b.sid = (await b.client.create(handler=handler if b.kind == "daemon" else "agent")).id
                    # The round's "short" response: the worker imports what it
                    # uses and keeps a connection, like the direct client.
                    await b.client.send_text(b.sid, warm_text)
                    b.daemon.remember()
                    worker = (await b.client.status(b.sid)).pid
                    procs[f"daemon/{b.kind}"] = psutil.Process(b.daemon.pid)
                    procs[f"worker/{b.kind}"] = psutil.Process(worker)
                if args.probe:
                    _sched_pids.update({"client": os.getpid(), "fakellm": server.proc.pid,
                                        "daemon": builds[0].daemon.pid,
                                        "worker": procs["worker/daemon"].pid})
                k = r % len(kinds)
                order = kinds[k:] + kinds[:k]
                if r == rounds - args.n:
                    c.quiet_gc()
                for kind in order:
                    before = cpu_of(procs)
                    if kind in ("daemon", "base"):
                        b = builds[0] if kind == "daemon" else builds[1]
                        assert b.client is not None
                        res = await run_daemon(b.client, b.sid)
                    elif kind == "direct":
                        res = await run_direct(http, url, body)
                    else:
                        res = await run_raw(http, url, body)
                    after = cpu_of(procs)
                    if res["tokens"] != args.tokens:
                        raise RuntimeError(f"{kind}: {res['tokens']} tokens, expected {args.tokens}")
                    if r >= args.warmup:
                        results[kind].append(res)
                        for name in procs:
                            cpu[kind][name.split("/")[0]] += after[name] - before[name]
                for b in builds:
                    assert b.client is not None
                    await b.client.remove(b.sid)
        finally:
            await http.aclose()
            for b in builds:
                if b.client is not None:
                    await b.client.close()

    try:
        for b in builds:
            b.daemon.start()
        asyncio.run(run())
    finally:
        for b in builds:
            b.daemon.cleanup()
        server.stop()

    figs: dict[str, Any] = {}
    rows = []
    for kind in kinds:
        ttft = c.summarize([x["ttft"] for x in results[kind]])
        rates = sorted(x["counted"] / (x["span"] / 1e9) for x in results[kind])
        rate_med = c.percentile(rates, 50)
        total_tokens = sum(x["tokens"] for x in results[kind])
        per_tok = {name: secs / total_tokens * 1e6 for name, secs in cpu[kind].items()}
        figs[kind] = {"ttft": ttft, "tokens_per_s_median": rate_med, "tokens_per_s_min": rates[0],
                      "cpu_us_per_token": per_tok}
        rows.append([kind, str(int(ttft["n"])), c.fmt_us(ttft["median_us"]), c.fmt_us(ttft["p99_us"]),
                     f"{rate_med:,.0f}", f"{rates[0]:,.0f}",
                     *(f"{per_tok.get(name, 0.0):.1f}" for name in ("client (this)", "daemon", "worker",
                                                                    "fakellm"))])
    direct = figs["direct"]
    overhead = figs["daemon"]["ttft"]["median_us"] - direct["ttft"]["median_us"]
    ratio = figs["daemon"]["tokens_per_s_median"] / direct["tokens_per_s_median"]
    server_bound = direct["tokens_per_s_median"] / figs["raw"]["tokens_per_s_median"]
    figs["ttft_overhead_us"] = overhead
    figs["throughput_ratio"] = ratio
    figs["direct_over_raw"] = server_bound
    rep.figures = figs
    rep.say(f"agent: {args.tokens} one-token chunks per stream from a FakeLLM process, "
            f"{args.history_kb} KiB of history, {args.n} rounds ({' / '.join(kinds)} in rotating "
            f"order), {os.cpu_count()} CPUs")
    rep.table(["client", "n", "TTFT med", "TTFT p99", "tok/s med", "tok/s min",
               "CPU µs/tok: client", "daemon", "worker", "fakellm"], rows)
    rep.say(f"  direct reaches {server_bound * 100:.0f}% of the raw read rate"
            + (" (the FakeLLM is the bottleneck of the direct client)" if server_bound > 0.9 else ""))
    if args.baseline:
        base = figs["base"]
        figs["base_ttft_overhead_us"] = base["ttft"]["median_us"] - direct["ttft"]["median_us"]
        figs["base_throughput_ratio"] = base["tokens_per_s_median"] / direct["tokens_per_s_median"]
        # Paired by round (the two daemons' streams ran next to each other),
        # which the load of a shared machine moves less than either median.
        diffs = sorted(a["ttft"] - b["ttft"] for a, b in zip(results["daemon"], results["base"]))
        figs["ttft_minus_base_us_median"] = c.percentile(diffs, 50) / 1000
        rep.say(f"  baseline ({args.baseline}): first-token overhead "
                f"{figs['base_ttft_overhead_us'] / 1000:.2f} ms, throughput "
                f"{figs['base_throughput_ratio'] * 100:.0f}% of direct; this build: "
                f"{overhead / 1000:.2f} ms, {ratio * 100:.0f}%; first token minus the "
                f"baseline's in the same round, median {c.percentile(diffs, 50) / 1e6:+.2f} ms")
    if probe_file is not None and daemon_probe is not None:
        for kind in ("daemon", "direct"):
            attach_stamps(results[kind], probe_file, "line", "s_")
        attach_stamps(results["daemon"], daemon_probe, "handled", "d_")
        figs["probe_ms"] = probe_table(rep, results)
        if args.profile:
            merge_profiles(rep, args.profile)
    rep.goal("first-token overhead <= 2 ms (median)", overhead / 1000, 2.0, f"{overhead / 1000:.2f} ms")
    rep.goal("daemon throughput >= 90% of direct", ratio * 100, 90.0, f"{ratio * 100:.0f}%",
             higher_is_better=True)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
