"""The process the daemon lists its lazy MCP servers' tools with.

    python -P -m session_worker.mcplist < order > answer      (msgpack: ipc.mcplist)

Started by the daemon (`supervisor.spawn.mcplist`), by exec, as the daemon's
user; with `--as UID:GID` it first opens the daemon's Python to that uid
where a directory on the way is closed to it (`session_worker.worker._reach`, as
the zygote does), then becomes it, before it reads its order: it lists as
that user (never the daemon's privileges: a uid of no session, or the
sessions' shared user; the daemon's own only where sessions run as it too), with an environment of PATH, LANG and the variables the servers'
tables name.  It confines itself as a session's worker does: no core
dumps, not dumpable, killed with its parent.  Each stdio server is started
by a tool host of its own sandbox (`session_worker.worker.sandbox`, as a session's
tools are), in an empty directory and with no network whatever
`[sandbox] network` says: no session's identity, workspace or network.
An HTTP server is reached from here, as a session's worker reaches it.

Each server is started, asked for its tools (and whether it offers
resources), and stopped; the answer is one `McpListing` a server, its
tools bounded as a session bounds them (`_mcp.adapt_all`), or why it could
not be listed: its exit code and the last words of its stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path

import msgspec

from ipc.linux import set_dumpable, set_pdeathsig
from ipc.mcp import MAX_SCHEMA_BYTES, MAX_TOOLS_PER_SERVER, ListedTool, McpListing, RefusedTool, bounded, listing_key
from ipc.mcplist import McpListOrder, order_decoder
from ipc.settings import McpServer, SessionSettings
# Imported before the lister becomes the session uid (`_become`): the
# checkout itself may be a directory only root can read, which no cover opens.
from session_worker.agent._errors import McpServerError
from session_worker.agent._mcp import Listed, adapt_all
from session_worker.agent._mcpclient import McpConnection
from session_worker.worker import _reach, sandbox

__all__ = ["list_servers", "main"]

_ORDER_BYTES = 16 << 20


async def list_servers(settings: SessionSettings, workspace: Path) -> list[McpListing]:
    """Every server of `settings.mcp.servers`, listed side by side."""
    return list(await asyncio.gather(*(_list_one(s, settings, workspace) for s in settings.mcp.servers)))


async def _list_one(server: McpServer, settings: SessionSettings, workspace: Path) -> McpListing:
    key = listing_key(server)
    timeout = settings.mcp.start_timeout_secs
    connection = McpConnection(server, workspace)
    try:
        listed = await connection.list_tools(timeout)
    except McpServerError as exc:
        return McpListing(name=server.name, key=key, state="unavailable", error=str(exc)[:4000])
    except Exception as exc:
        return McpListing(name=server.name, key=key, state="unavailable",
                          error=f"MCP server {server.name!r} failed: {type(exc).__name__}: {exc}"[:4000])
    finally:
        await connection.close()

    async def never(source: str, args: object, env: object) -> tuple[bool, str]:
        raise AssertionError("only listed here")

    kept, refused = adapt_all(server.name, never, [Listed(t.name, t.description, t.schema) for t in listed], set())
    tools: list[ListedTool] = []
    for item, tool in kept:
        schema = json.dumps(tool.parameters, ensure_ascii=False)
        if len(schema) > MAX_SCHEMA_BYTES:  # (made whole: a little longer than the server's)
            refused.append({"tool": repr(item.name)[:80], "reason": f"its input schema is over {MAX_SCHEMA_BYTES} bytes"})
            continue
        tools.append(ListedTool(item.name, tool.description, schema))
    return bounded(McpListing(
        name=server.name, key=key, state="listed", version=connection.version, tools=tools,
        refused=[RefusedTool(r["tool"][:100], r["reason"][:200]) for r in refused[:2 * MAX_TOOLS_PER_SERVER]],
        resources=connection.resources,
    ))


def _settings_for_listing(settings: SessionSettings) -> SessionSettings:
    """No network for the servers, whatever sessions get."""
    return msgspec.structs.replace(settings, sandbox=msgspec.structs.replace(settings.sandbox, network="none"))


def _become(argv: list[str]) -> None:
    """`--as UID:GID`: the daemon's Python opened to it, then its identity
    taken for good (no groups, no way back) before anything else runs."""
    if argv[:1] != ["--as"] or len(argv) != 2:
        if argv:
            raise SystemExit("usage: python -m session_worker.mcplist [--as UID:GID]")
        return
    uid, _, gid = argv[1].partition(":")
    # Run with -P: no entry of sys.path is the working directory's by
    # accident (a checkout run from its own directory is on it by its .pth).
    _reach.open_to_sessions(_reach.closed_dirs(sys.path))
    os.setgroups([])
    os.setresgid(int(gid), int(gid), int(gid))
    os.setresuid(int(uid), int(uid), int(uid))


def main() -> int:
    parent = os.getppid()
    _become(sys.argv[1:])  # first: a change of identity clears the death signal and dumpable
    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    set_dumpable(False)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    order: McpListOrder = order_decoder.decode(sys.stdin.buffer.read(_ORDER_BYTES))
    settings = _settings_for_listing(msgspec.msgpack.decode(order.settings, type=SessionSettings))
    if settings.agent.limits.max_file_size_mb is not None:
        size = settings.agent.limits.max_file_size_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    # As a session's worker (session_worker.worker.main): soft and hard, never above the hard one we got.
    files = min(settings.agent.limits.max_open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    workspace = Path(order.workspace)
    sandbox.configure(sandbox.plan_for(order.sandbox, settings, workspace, per_session_uid=order.own_uid))
    try:
        listings = asyncio.run(list_servers(settings, workspace))
    finally:
        host = sandbox.current()
        if host is not None:
            host.close()
    sys.stdout.buffer.write(msgspec.msgpack.encode(listings))
    sys.stdout.buffer.flush()
    return 0
