"""What a stdio MCP tool call costs over a built-in tool doing the same work.

    .venv/bin/python bench/mcp.py [--calls 300] [--firsts 5] [--kib 4] [--json]

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
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _BENCH]
sys.path.insert(0, str(_BENCH.parent))

import asyncio  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import _common as c  # noqa: E402

c.setup_path()

import msgspec  # noqa: E402

from ipc import messages as m  # noqa: E402
from ipc.settings import McpSettings, SandboxSettings, SessionSettings  # noqa: E402
from session_worker import sandbox  # noqa: E402
from session_worker.agent._builtins import builtin_tools  # noqa: E402
from session_worker.agent._mcp import McpTools  # noqa: E402
from session_worker.agent._tools import Tool, ToolEnv  # noqa: E402

SERVER = c.REPO / "tests" / "mcp_servers.py"


class _Ctx:
    """The turn context a tool is handed: these tools use none of it."""

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        if kind != "tool_result":
            print(f"notice {kind}: {data}", file=sys.stderr)


def _settings(site: str) -> SessionSettings:
    python = os.path.realpath(sys.executable)
    servers = [{"name": "bench", "command": [python, str(SERVER), "stdio", site]}]
    return SessionSettings(
        mcp=msgspec.convert({"servers": servers}, McpSettings),
        sandbox=SandboxSettings(read_paths=[site, str(SERVER.parent)]),
    )


async def _mcp_tool(settings: SessionSettings, ws: Path, ctx: Any) -> tuple[McpTools, Tool]:
    tools = McpTools(settings.mcp, ws)
    await tools.discover(ctx.notice)
    found = [t for t in tools.tools() if t.name == "mcp__bench__read_file"]
    if not found:
        raise SystemExit("the MCP server did not list read_file")
    return tools, found[0]


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
    boxed_tools: McpTools | None = None
    mcp_boxed: Tool | None = None
    if host is not None:
        sandbox._current = host  # noqa: SLF001
        boxed_tools, mcp_boxed = await _mcp_tool(settings, ws, ctx)

    variants: dict[str, tuple[Tool, dict[str, Any], sandbox.ToolHost | None]] = {
        "builtin read_file": (builtins["read_file"], {"path": "data.txt"}, None),
        "builtin bash cat": (builtins["bash"], {"command": "cat data.txt"}, None),
        "mcp stdio read_file": (mcp_local, {"path": "data.txt"}, None),
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
    if boxed_tools is not None:
        await boxed_tools.aclose()
    if host is not None:
        host.close()
    return {k: v for k, v in out.items() if v}


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
    args = p.parse_args()
    rep = c.Report("mcp", args.json)
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
    if "mcp stdio read_file, sandboxed" in s:
        boxed = s["mcp stdio read_file, sandboxed"]["median_us"] - base
        rep.say(f"REPORT mcp_stdio_overhead_sandboxed: +{boxed / 1000:.2f} ms over the built-in read_file")
    rep.figures.update(s)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
