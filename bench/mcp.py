"""What a stdio MCP tool call costs over a built-in tool doing the same work.

    .venv/bin/python bench/mcp.py [--calls 300] [--firsts 5] [--kib 4] [--first-turns 5] [--json]

The work: read a `--kib` KiB text file of the workspace and return it.  Each
variant is the `Tool` the agent's registry holds, run as the turn loop runs
it (`tool.run(args, env)`, in this process's event loop, as in a worker):

* builtin read_file: the built-in tool (a thread reads the file beneath the
  workspace's directory fd);
* builtin bash `cat`: the built-in that starts a process per call, unconfined
  and through the session's tool host inside bubblewrap's namespaces;
* mcp stdio read_file: the same read by an MCP server built with the SDK
  (tests/mcp_servers.py), offered as `mcp__bench__read_file`: a JSON-RPC
  round trip over the server's stdin/stdout, the SDK on both ends; the
  server started by the worker (`sandbox.mode = "off"`) and by the tool
  host inside the namespaces (as a session's server runs by default).

Steady state (the server, or the host, already up), the variants
interleaved call by call; medians and p99 over `--calls`.  Then the first
call of a session, which starts the server, initializes the connection and
lists its tools (`McpTools.discover`), `--firsts` times.  The overhead is
reported as the difference of medians against the built-in read_file and
against bash `cat`; no goal is set by the issue: the figures are reported.
The same read by the same server over streamable HTTP (`mcp http
read_file`: the server in a process of its own on 127.0.0.1) is timed beside
them.

**First turns** (`--first-turns N`, 0 skips): what MCP servers cost a
session that never calls one.  One daemon per variant, all running side by
side: no server; one stdio server; six (four stdio, one streamable HTTP,
one legacy SSE), each lazy (the daemon lists them once and tells every
session) and eager (`lazy = false`: every session starts and lists every
server at its first turn, as every session did before lazy listing).  In
rotating order, N times: create a session, time its first turn (a
text-only reply: no MCP tool called) from `send` to `TurnDone`, then the
private memory (USS) and process count of its worker's tree, then remove
it.  Medians; the difference to "0 servers" is what the servers cost.
Goal (issue 34): six lazy servers' first turn within 50 ms of none's.
"""

from __future__ import annotations

import _path  # noqa: F401  (first: the checkout on sys.path, not bench/)

import sys
from pathlib import Path

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

from bench import _common as c

import msgspec

from ipc import messages as m
from ipc.settings import McpSettings, SandboxSettings, SessionSettings
from session_worker.worker import sandbox
from session_worker.agent._builtins import builtin_tools
from session_worker.agent._mcp import McpTools
from session_worker.agent._tools import Tool, ToolEnv

SERVER = c.REPO / "tests" / "mcp_servers.py"


class _Ctx:
    """The turn context a tool is handed: these tools use none of it."""

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        if kind != "tool_result":
            print(f"notice {kind}: {data}", file=sys.stderr)


def _settings(site: str, web: str = "") -> SessionSettings:
    python = os.path.realpath(sys.executable)
    servers = [{"name": "bench", "command": [python, str(SERVER), "stdio", site]}]
    if web:
        servers = [{"name": "benchweb", "url": f"{web}/mcp/"}]
    return SessionSettings(
        mcp=msgspec.convert({"servers": servers}, McpSettings),
        sandbox=SandboxSettings(read_paths=[site, str(SERVER.parent)]),
    )


async def _mcp_tool(settings: SessionSettings, ws: Path, ctx: Any) -> tuple[McpTools, Tool]:
    tools = McpTools(settings.mcp, ws)
    await tools.discover(ctx.notice)
    found = [t for t in tools.tools() if t.name.endswith("__read_file")]
    if not found:
        raise SystemExit("the MCP server did not list read_file")
    return tools, found[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http_server(site: str, cwd: Path) -> str:
    """tests/mcp_servers.py over HTTP, a process of its own (reading files of `cwd`)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, str(SERVER), "http", site, str(port)], cwd=cwd,
                            env=c.child_env(), start_new_session=True, stderr=subprocess.DEVNULL)
    c.on_exit(lambda: c.kill_process_tree([proc.pid]))
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the MCP HTTP server did not start")
        time.sleep(0.05)


async def measure(calls: int, firsts: int, kib: int) -> dict[str, list[int]]:
    import mcp

    site = str(Path(mcp.__file__).resolve().parent.parent)
    ws = Path(tempfile.mkdtemp(prefix="sdb-mcp-ws-")).resolve()
    c.on_exit(lambda: shutil.rmtree(ws, ignore_errors=True))
    text = ("sessiond bench line\n" * (kib * 1024 // 20 + 1))[: kib * 1024]
    (ws / "data.txt").write_text(text)
    settings = _settings(site)
    ctx = _Ctx()
    env = ToolEnv(ws, settings, ctx)  # type: ignore[arg-type]
    bwrap = shutil.which("bwrap") or ""
    plan = sandbox.plan_for(m.SandboxBoot(namespaces=bool(bwrap), bwrap=bwrap, landlock_abi=_landlock()),
                            settings, ws, per_session_uid=False)
    host = sandbox.ToolHost(plan) if plan is not None and not plan.why_refused else None
    if host is None:
        print(f"no sandbox here ({plan.why_refused if plan else 'off'}): namespaced variants skipped",
              file=sys.stderr)
    builtins = builtin_tools()

    sandbox._current = None  # noqa: SLF001 (the worker's one host, swapped per variant)
    local_tools, mcp_local = await _mcp_tool(settings, ws, ctx)
    web_tools, mcp_web = await _mcp_tool(_settings(site, _http_server(site, ws)), ws, ctx)
    boxed_tools: McpTools | None = None
    mcp_boxed: Tool | None = None
    if host is not None:
        sandbox._current = host  # noqa: SLF001
        boxed_tools, mcp_boxed = await _mcp_tool(settings, ws, ctx)

    variants: dict[str, tuple[Tool, dict[str, Any], sandbox.ToolHost | None]] = {
        "builtin read_file": (builtins["read_file"], {"path": "data.txt"}, None),
        "builtin bash cat": (builtins["bash"], {"command": "cat data.txt"}, None),
        "mcp stdio read_file": (mcp_local, {"path": "data.txt"}, None),
        "mcp http read_file": (mcp_web, {"path": "data.txt"}, None),
    }
    if host is not None and mcp_boxed is not None:
        variants["builtin bash cat, sandboxed"] = (builtins["bash"], {"command": "cat data.txt"}, host)
        variants["mcp stdio read_file, sandboxed"] = (mcp_boxed, {"path": "data.txt"}, host)
    out: dict[str, list[int]] = {name: [] for name in variants}

    async def one(name: str) -> int:
        tool, args, box = variants[name]
        sandbox._current = box  # noqa: SLF001
        t = time.perf_counter_ns()
        result = await tool.run(args, env)
        elapsed = time.perf_counter_ns() - t
        if not result.startswith("sessiond bench line"):
            raise SystemExit(f"{name}: unexpected result {result[:200]!r}")
        return elapsed

    for name in variants:  # warm: threads, the host, the connections
        for _ in range(3):
            await one(name)
    for i in range(calls):
        names = list(variants)
        for name in names if i % 2 else names[::-1]:
            out[name].append(await one(name))

    out["first mcp stdio (start, initialize, list)"] = []
    out["first mcp stdio, sandboxed"] = []
    for _ in range(firsts):
        for boxed in (False, True):
            if boxed and host is None:
                continue
            sandbox._current = host if boxed else None  # noqa: SLF001
            t = time.perf_counter_ns()
            fresh, tool = await _mcp_tool(settings, ws, ctx)
            await tool.run({"path": "data.txt"}, env)
            key = "first mcp stdio, sandboxed" if boxed else "first mcp stdio (start, initialize, list)"
            out[key].append(time.perf_counter_ns() - t)
            await fresh.aclose()
    await local_tools.aclose()
    await web_tools.aclose()
    if boxed_tools is not None:
        await boxed_tools.aclose()
    if host is not None:
        host.close()
    return {k: v for k, v in out.items() if v}


def _servers(site: str, web: str, count: int, lazy: bool) -> str:
    """`count` [[mcp.servers]] tables: stdio ones, and past four an HTTP and an SSE one."""
    python = os.path.realpath(sys.executable)
    tables = []
    for i in range(count):
        if i < 4:
            where = f"command = [{python!r}, {str(SERVER)!r}, \"stdio\", {site!r}]"
        elif i == 4:
            where = f'url = "{web}/mcp/"'
        else:
            where = f'url = "{web}/legacy/sse"\ntype = "sse"'
        tables.append(f'[[mcp.servers]]\nname = "s{i}"\n{where}\nlazy = {str(lazy).lower()}\n')
    return "\n".join(tables)


def _tree(pid: int) -> tuple[int, int]:
    """(private bytes, processes) of a worker and everything below it."""
    import psutil

    uss = procs = 0
    try:
        top = psutil.Process(pid)
        for proc in [top, *top.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                uss += proc.memory_full_info().uss
                procs += 1
    except psutil.Error:
        pass
    return uss, procs


async def first_turns(rounds: int) -> dict[str, dict[str, list[int]]]:
    """Per variant: the first turn's time (ns), the session tree's USS and processes."""
    import mcp

    from fakellm import FakeLLM, text_stream
    from supervisor.ctl.client import AsyncClient

    site = str(Path(mcp.__file__).resolve().parent.parent)
    ws = Path(tempfile.mkdtemp(prefix="sdb-mcp-web-")).resolve()
    c.on_exit(lambda: shutil.rmtree(ws, ignore_errors=True))
    web = _http_server(site, ws)
    variants = {"0 servers": (0, True), "1 lazy": (1, True), "1 eager": (1, False),
                "6 lazy": (6, True), "6 eager": (6, False)}
    out: dict[str, dict[str, list[int]]] = {v: {"ns": [], "uss": [], "procs": []} for v in variants}
    with FakeLLM() as llm:
        llm.respond = lambda request: text_stream("ok")
        daemons: dict[str, c.BenchDaemon] = {}
        for name, (count, lazy) in variants.items():
            config = f"""
[agent]
handler = "agent"
[provider]
base_url = "{llm.base_url}"
model = "bench"
[sandbox]
read_paths = [{site!r}, {str(SERVER.parent)!r}]
[mcp]
start_timeout_secs = 60
{_servers(site, web, count, lazy)}
"""
            daemons[name] = c.BenchDaemon(config, tag="sd-mcp").start()
        for name, d in daemons.items():  # the daemon's lists, before any session is timed
            async with await AsyncClient.connect(d.socket, client_name="bench-mcp") as client:
                deadline = time.monotonic() + 120
                while any(x.get("state") == "pending" for x in (await client.stats()).mcp.values()):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{name}: the daemon did not list its servers")
                    await asyncio.sleep(0.1)
                bad = {k: x for k, x in (await client.stats()).mcp.items() if x.get("state") != "listed"}
                if bad:
                    raise SystemExit(f"{name}: servers not listed: {bad}")
        for i in range(rounds):
            names = list(daemons)
            for name in names[i % len(names):] + names[:i % len(names)]:
                async with await AsyncClient.connect(daemons[name].socket, client_name="bench-mcp") as client:
                    sid = (await client.create()).id
                    t = time.perf_counter_ns()
                    await client.send_text(sid, "hello")
                    out[name]["ns"].append(time.perf_counter_ns() - t)
                    uss, procs = _tree((await client.status(sid)).pid or 0)
                    out[name]["uss"].append(uss)
                    out[name]["procs"].append(procs)
                    await client.remove(sid)
        for d in daemons.values():
            d.cleanup()
    return out


def _report_first_turns(rep: c.Report, turns: dict[str, dict[str, list[int]]]) -> None:
    import statistics

    base = statistics.median(turns["0 servers"]["ns"]) / 1e6
    base_mem = statistics.median(turns["0 servers"]["uss"])
    rows = []
    for name, got in turns.items():
        ms = statistics.median(got["ns"]) / 1e6
        mem = statistics.median(got["uss"])
        rows.append([name, str(len(got["ns"])), f"{ms:.1f} ms", f"{ms - base:+.1f} ms", c.fmt_bytes(mem),
                     f"{(mem - base_mem) / 1048576:+.1f} MiB", str(int(statistics.median(got["procs"])))])
        rep.figures[f"first turn {name}"] = {"median_ms": ms, "uss_bytes": mem, "processes": got["procs"]}
    rep.say(f"a session's first turn, no MCP tool called (medians of {len(turns['0 servers']['ns'])}; "
            f"load {os.getloadavg()[0]:.2f})")
    rep.table(["servers", "n", "first turn", "vs none", "session USS", "vs none", "processes"], rows)
    lazy = statistics.median(turns["6 lazy"]["ns"]) / 1e6 - base
    eager = statistics.median(turns["6 eager"]["ns"]) / 1e6 - base
    rep.goal("mcp_first_turn_6_lazy", lazy, 50.0,
             f"six lazy servers add {lazy:+.1f} ms to a first turn (eager, as before: {eager:+.0f} ms); <= 50 ms")


def _landlock() -> int:
    """The kernel's Landlock ABI (0: none), as the daemon's probe finds it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(int(abi), 0)


def main() -> int:
    p = c.arg_parser(__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=300, help="steady-state calls per variant")
    p.add_argument("--firsts", type=int, default=5, help="first calls (server start) per variant")
    p.add_argument("--kib", type=int, default=4, help="size of the file read, KiB")
    p.add_argument("--first-turns", type=int, default=5, help="first turns per variant of configured "
                   "servers (0: skip)")
    args = p.parse_args()
    rep = c.Report("mcp", args.json)
    sys.path.insert(1, str(c.REPO / "tests"))  # fakellm, mcp_servers
    if args.first_turns:
        _report_first_turns(rep, asyncio.run(first_turns(args.first_turns)))
        rep.say()
    c.quiet_gc()
    samples = asyncio.run(measure(args.calls, args.firsts, args.kib))
    s = {k: c.summarize(v) for k, v in samples.items()}
    base = s["builtin read_file"]["median_us"]
    cat = s["builtin bash cat"]["median_us"]
    rep.say(f"one tool call reading a {args.kib} KiB file (steady state; variants interleaved)")
    rep.table(["variant", "n", "median", "p99", "vs builtin read_file", "vs bash cat"], [
        [name, str(int(f["n"])), c.fmt_us(f["median_us"]), c.fmt_us(f["p99_us"]),
         f"{f['median_us'] - base:+.0f} µs ({f['median_us'] / base:.1f}x)", f"{f['median_us'] - cat:+.0f} µs"]
        for name, f in s.items()
    ])
    rep.say()
    over = s["mcp stdio read_file"]["median_us"] - base
    rep.say(f"REPORT mcp_stdio_overhead: a stdio MCP call +{over / 1000:.2f} ms over the built-in read_file "
            f"({s['mcp stdio read_file']['median_us'] / base:.1f}x), "
            f"{(s['mcp stdio read_file']['median_us'] - cat) / 1000:+.2f} ms against bash cat")
    http = s["mcp http read_file"]["median_us"] - base
    rep.say(f"REPORT mcp_http_overhead: a streamable-HTTP MCP call +{http / 1000:.2f} ms over the built-in read_file")
    if "mcp stdio read_file, sandboxed" in s:
        boxed = s["mcp stdio read_file, sandboxed"]["median_us"] - base
        rep.say(f"REPORT mcp_stdio_overhead_sandboxed: +{boxed / 1000:.2f} ms over the built-in read_file")
    rep.figures.update(s)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
