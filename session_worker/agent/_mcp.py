"""MCP servers' tools, as tools of the session's registry.

Runs in the worker.  The operator lists servers (`[[mcp.servers]]`,
`ipc.settings.McpServer`); a session is offered `mcp.offered()`, which a
per-session override may only narrow.  Their tools become `Tool`s named
`mcp__<server>__<tool>` (the naming Claude Code uses), which enter the
same `ToolRegistry` as the built-ins.  From there the loop treats them as
any tool: argument checks, permission rules by name and main argument, the
output cap, the `tool_call`/`tool_result` notices, errors as results.

**What a server costs a session.**  A lazy server (the default) was listed
once by the daemon, and its tools come in the session's settings
(`mcp.listed`, matched to the server's table by `key`): the session offers
them without starting anything, and starts its own copy of the server
(`_mcpclient`: a stdio server in the session's sandbox, an HTTP one
reached by the worker) when the model first calls one of them, then keeps
it while the worker lives.  A session that never calls an MCP tool starts
no MCP process.  While the daemon is still listing a server (`pending`),
a turn waits for its list, up to `start_timeout_secs`, then lists it
itself.  An eager server (`lazy = false`), and a lazy one the daemon gave
no list for, is started and listed by the session at its first turn
(`McpTools.discover`), as its tools may depend on the session.

**A server that cannot start** (the daemon could not list it, or the
session's copy did not come up) is unavailable: its tools are withdrawn,
the client is told once (`mcp_server_unavailable`, with the server's exit
code and its last words on stderr) and the model reads the same in the
call's result; it is not tried again before `retry_backoff_secs` (doubled
at each failure in a row, up to 32 times), so no turn waits for it.

**Changes.**  A server's `notifications/tools/list_changed`, or a version
other than the one the daemon listed, makes the session list it again
itself at its next turn; a reload changes what the daemon lists.

What a server lists is hostile input: a name that does not fit the
providers' tool-name rule (`^[A-Za-z0-9_-]{1,64}$`) is rewritten to one that
does, with a digest of the original that keeps it unique (calls still go
out under the server's own name); a name past 256 characters, a schema that
is not a JSON object schema or is over 16 KiB, and tools past 128 per
server are refused (`mcp_tools_refused` notice); a description is cut to
2 KiB.  A server that offers resources gets two tools more:
`mcp__<server>__list_resources` and `mcp__<server>__read_resource`.
The SDK itself is imported only when there is a server to connect.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from session_worker import tracing
from session_worker.agent._errors import McpServerError, McpStartError, ToolError
from session_worker.agent._tools import Tool, ToolEnv
from ipc.install import install_command
from ipc.mcp import MAX_DESCRIPTION_CHARS, MAX_SCHEMA_BYTES, MAX_SOURCE_NAME, MAX_TOOLS_PER_SERVER, PREFIX, \
    McpListing, listing_key
from ipc.settings import McpServer, McpSettings

if TYPE_CHECKING:
    from session_worker.agent._mcpclient import McpConnection

__all__ = ["McpTools", "adapt_tool", "close_all", "tool_name"]

log = logging.getLogger("sessiond.mcp")

_NAME_RULE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_NAME = 64
_MAX_BACKOFF_FACTOR = 32

Notify = Callable[[str, dict[str, Any]], None]
# How a tool of a server is run: (the server's name for it, arguments, env)
# -> (the server says it failed, the result as text).
Invoke = Callable[[str, dict[str, Any], ToolEnv], Awaitable[tuple[bool, str]]]


def tool_name(server: str, raw: str, taken: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The name the model sees for `raw` of `server`, or None (refused)."""
    if not isinstance(raw, str) or not raw or len(raw) > MAX_SOURCE_NAME:
        return None
    plain = f"{PREFIX}{server}__{raw}"
    if _NAME_RULE.match(plain) and plain not in taken:
        return plain
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    room = _MAX_NAME - len(PREFIX) - len(server) - 2 - len(digest) - 1
    safe = _UNSAFE.sub("_", raw)[: max(room, 0)]
    name = f"{PREFIX}{server}__{safe}_{digest}" if safe else f"{PREFIX}{server}__{digest}"
    if not _NAME_RULE.match(name) or name in taken:
        return None
    return name


def schema_of(raw: Any) -> dict[str, Any] | str:
    """The input schema as the model gets it, or why it is refused."""
    if not isinstance(raw, dict) or raw.get("type", "object") != "object":
        return "its input schema is not a JSON object schema"
    try:
        text = json.dumps(raw, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return "its input schema is not JSON"
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        return f"its input schema is over {MAX_SCHEMA_BYTES} bytes"
    schema: dict[str, Any] = json.loads(text)
    schema["type"] = "object"
    properties = schema.setdefault("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(r, str) for r in required):
        return "its input schema's properties or required list is malformed"
    return schema


def description_of(raw: str) -> str:
    text = raw.strip() if isinstance(raw, str) else ""
    if len(text) > MAX_DESCRIPTION_CHARS:
        text = text[:MAX_DESCRIPTION_CHARS] + " [description cut]"
    return text


@dataclass(frozen=True, slots=True)
class Listed:
    """A tool as a server listed it (`_mcpclient.ListedTool`, or one of the
    daemon's list, its schema decoded): still hostile input."""

    name: str
    description: str
    schema: Any


def adapt_tool(server: str, invoke: Invoke, listed: Listed, taken: set[str]) -> Tool | str:
    """A registry Tool calling `listed` on `server`, or why it is refused."""
    name = tool_name(server, listed.name, taken)
    if name is None:
        return "its name is empty, over 256 characters, or cannot be made unique"
    schema = schema_of(listed.schema)
    if isinstance(schema, str):
        return schema
    required = schema.get("required") or []
    main_arg = required[0] if required else next(iter(schema["properties"]), None)
    description = description_of(listed.description) or f"Tool {listed.name} of the MCP server {server}."
    source = listed.name

    async def run(args: dict[str, Any], env: ToolEnv) -> str:
        is_error, text = await invoke(source, args, env)
        if is_error:
            raise ToolError(f"{name} reported an error: {text}")
        return text

    return Tool(name, description, schema, main_arg, run)


def adapt_all(server: str, invoke: Invoke, listed: Sequence[Listed],
              names: set[str]) -> tuple[list[tuple[Listed, Tool]], list[dict[str, str]]]:
    """Every tool of a listing that passes its bounds (with what it was
    made from), and the refused ones with their reasons (`names`: taken so
    far, grows)."""
    kept: list[tuple[Listed, Tool]] = []
    refused: list[dict[str, str]] = []
    for item in listed:
        shown = repr(item.name)[:80] if isinstance(item.name, str) else "?"
        if len(kept) >= MAX_TOOLS_PER_SERVER:
            refused.append({"tool": shown, "reason": f"more than {MAX_TOOLS_PER_SERVER} tools"})
            continue
        tool = adapt_tool(server, invoke, item, names)
        if isinstance(tool, str):
            refused.append({"tool": shown, "reason": tool})
            continue
        names.add(tool.name)
        kept.append((item, tool))
    return kept, refused


@dataclass(slots=True)
class _Down:
    """A server this session does not try before `until` (monotonic)."""

    until: float
    error: str
    failures: int


class McpTools:
    """The MCP servers of one session and the tools they listed."""

    def __init__(self, settings: McpSettings, workspace: Path) -> None:
        self._workspace = workspace
        self._settings = settings
        self._servers: list[McpServer] = settings.offered()
        self._connections: dict[str, McpConnection] = {}
        self._tools: dict[str, list[Tool]] = {}
        # The daemon's list each server's tools came from (None: the
        # session listed it itself), and the servers to list again.
        self._from: dict[str, McpListing | None] = {}
        self._stale: set[str] = set()
        self._down: dict[str, _Down] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        # The registry must be built again (a server went down mid-turn).
        self.changed = False
        self._listing_came: asyncio.Event | None = None

    def tools(self) -> list[Tool]:
        """Offered now, in the operator's order of servers."""
        return [tool for server in self._servers for tool in self._tools.get(server.name, ())]

    def starts(self) -> dict[str, int]:
        """How often this session started each server (tests, bench)."""
        return {name: c.starts for name, c in self._connections.items()}

    def reconfigure(self, settings: McpSettings) -> list[McpConnection]:
        """New settings: servers no longer offered, or changed, are dropped
        (their connections returned, for the caller to close); a new list
        from the daemon replaces the one a server's tools came from; what
        is new is listed at the next `discover`."""
        servers = settings.offered()
        kept = {s.name for s in servers} & {s.name for s in self._servers if s in servers}
        dropped = [c for name, c in self._connections.items() if name not in kept]
        self._connections = {n: c for n, c in self._connections.items() if n in kept}
        self._tools = {n: t for n, t in self._tools.items() if n in kept}
        self._down = {n: d for n, d in self._down.items() if n in kept}
        self._stale &= kept
        self._servers = servers
        self._settings = settings
        for server in servers:
            came_from = self._from.get(server.name)
            listing = self._listing(server)
            if came_from is not None and listing != came_from:
                self._tools.pop(server.name, None)  # a newer list (or none): adopted at the next turn
                self._from.pop(server.name, None)
            if listing is not None and listing.state == "listed" and server.name in self._down \
                    and server.name not in self._connections:
                del self._down[server.name]  # the daemon lists it again: offered again
        if self._listing_came is not None:
            self._listing_came.set()
        return dropped

    def _listing(self, server: McpServer) -> McpListing | None:
        """The daemon's list for this server as configured, if any."""
        if not server.lazy:
            return None
        key = listing_key(server)
        return next((x for x in self._settings.listed if x.name == server.name and x.key == key), None)

    # -- at a turn's start ---------------------------------------------------

    async def discover(self, notice: Notify, taken: Sequence[str] = ()) -> bool:
        """Offer the tools of every offered server not offered yet: from the
        daemon's list, else by listing the server here; True when the set
        of tools changed.  `taken`: names of the other tools."""
        await self._await_pending()
        changed, self.changed = self.changed, False
        now = time.monotonic()
        names = set(taken) | {t.name for t in self.tools()}
        to_list: list[McpServer] = []
        for server in self._servers:
            name = server.name
            down = self._down.get(name)
            if down is not None and now < down.until:
                continue
            if name in self._tools and name not in self._stale:
                continue
            listing = self._listing(server)
            if name in self._stale or listing is None or listing.state == "pending":
                to_list.append(server)
            elif listing.state == "unavailable":
                self._set_down(server, listing.error, notice, retry=False)
            elif self._adopt(server, listing, names, notice):
                changed = True
        if to_list:
            changed = await self._list_here(to_list, notice, names) or changed
        return changed

    async def _await_pending(self) -> None:
        """The daemon is still listing some lazy server: wait for its list
        (it comes as new settings), up to start_timeout_secs."""
        deadline = time.monotonic() + self._settings.start_timeout_secs

        def pending() -> list[str]:
            return [s.name for s in self._servers if s.name not in self._tools
                    and (x := self._listing(s)) is not None and x.state == "pending"]

        if not pending():
            return
        with tracing.span("mcp.wait_lists", attributes={"sessiond.mcp.servers": pending()}) as span:
            while waiting := pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    span.set("sessiond.mcp.not_listed", waiting)
                    return
                event = self._listing_came = self._listing_came or asyncio.Event()
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), left)
                except TimeoutError:
                    pass

    def _adopt(self, server: McpServer, listing: McpListing, names: set[str], notice: Notify) -> bool:
        listed = [Listed(t.name, t.description, _json(t.schema)) for t in listing.tools]
        kept, refused = adapt_all(server.name, self._invoker(server), listed, names)
        tools = [tool for _, tool in kept] + (self._resource_tools(server, names) if listing.resources else [])
        refused += [{"tool": r.tool, "reason": r.reason} for r in listing.refused]
        self._tools[server.name] = tools
        self._from[server.name] = listing
        if refused:
            notice("mcp_tools_refused", {"server": server.name, "tools": refused})
        return bool(tools)

    async def _list_here(self, servers: list[McpServer], notice: Notify, names: set[str]) -> bool:
        """Start (or reuse) each server and list its tools in this session."""
        try:
            await _client_module()  # once, before the servers connect side by side
        except ImportError as exc:
            # The hint only when the SDK is missing: a module it needs that
            # this uid cannot read is another matter (docs/operations.md).
            missing = isinstance(exc, ModuleNotFoundError) and (exc.name or "").partition(".")[0] == "mcp"
            why = f"the MCP SDK cannot be imported ({exc})" + (f": {install_command('mcp')}" if missing else "")
            for server in servers:
                self._set_down(server, why, notice)
            return False
        outcomes = await asyncio.gather(*(self._list(s) for s in servers), return_exceptions=True)
        changed = False
        for server, outcome in zip(servers, outcomes):
            self._stale.discard(server.name)
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                why = str(outcome) if isinstance(outcome, McpServerError) else (
                    f"MCP server {server.name!r} failed: {type(outcome).__name__}: {outcome}")
                self._set_down(server, why, notice)
                continue
            for tool in self._tools.get(server.name, ()):
                names.discard(tool.name)  # listed again: its own old names are free
            kept, refused = adapt_all(server.name, self._invoker(server), outcome, names)
            connection = self._connections.get(server.name)
            tools = [tool for _, tool in kept]
            tools += self._resource_tools(server, names) if connection is not None and connection.resources else []
            self._tools[server.name] = tools
            self._from[server.name] = None
            self._down.pop(server.name, None)
            changed = True
            log.info("MCP server %s: %d tool(s)%s", server.name, len(tools),
                     f", {len(refused)} refused" if refused else "")
            if refused:
                notice("mcp_tools_refused", {"server": server.name, "tools": refused})
        return changed

    async def _list(self, server: McpServer) -> list[Listed]:
        connection = await self._connection(server)
        listed = await connection.list_tools(self._settings.start_timeout_secs)
        return [Listed(t.name, t.description, t.schema) for t in listed]

    # -- a call --------------------------------------------------------------

    async def _connection(self, server: McpServer) -> McpConnection:
        connection = self._connections.get(server.name)
        if connection is None:
            client = await _client_module()
            connection = self._connections[server.name] = client.McpConnection(
                server, self._workspace, self._stale.add)
        return connection

    def _invoker(self, server: McpServer) -> Invoke:
        async def invoke(source: str, args: dict[str, Any], env: ToolEnv) -> tuple[bool, str]:
            limits = env.settings.mcp
            connection = await self._start(server, env)  # (imports the SDK off the loop, first)
            from session_worker.agent._mcpclient import render_result

            result = await connection.call(source, args, limits.call_timeout_secs, limits.start_timeout_secs)
            return render_result(result, env.settings.tools.output_limit_bytes)

        return invoke

    async def _start(self, server: McpServer, env: ToolEnv) -> McpConnection:
        """The server's connection, started now if it is not running (the
        session's first call of it); a start that fails makes the server
        unavailable for its backoff (told once, its tools withdrawn)."""
        if server not in self._servers:
            raise McpServerError(f"MCP server {server.name!r} is no longer offered to this session")
        # One start at a time per server: calls side by side share it, and
        # one that waited behind a failed start fails with it, at once.
        async with self._starting.setdefault(server.name, asyncio.Lock()):
            down = self._down.get(server.name)
            if down is not None and time.monotonic() < down.until:
                later = "" if down.until == float("inf") else \
                    f"; not tried again for {down.until - time.monotonic():.0f} s"
                raise McpStartError(down.error + later)
            connection = await self._connection(server)
            if connection.connected:
                return connection
            try:
                await connection.connect(env.settings.mcp.start_timeout_secs)
            except McpStartError as exc:
                wait = self._set_down(server, str(exc), env.ctx.notice)
                raise McpStartError(f"{exc}; its tools are withdrawn, and it is not tried again for "
                                    f"{wait:.0f} s") from None
            # Counted by the daemon (sessiond_mcp_server_starts_total{outcome="ok"}); no line for a person.
            env.ctx.notice("mcp_server_started", {"server": server.name, "version": connection.version})
        self._down.pop(server.name, None)
        listing = self._from.get(server.name)
        if listing is not None and connection.version != listing.version:
            # Not the version the daemon listed: its own list, at the next turn.
            self._stale.add(server.name)
        return connection

    def _set_down(self, server: McpServer, why: str, notice: Notify, retry: bool = True) -> float:
        """Unavailable for its backoff: its tools withdrawn, the client told
        once (not again while it stays down).  `retry` False: the daemon
        could not list it, and tries again itself (its list, when it comes,
        offers the server again)."""
        before = self._down.get(server.name)
        failures = before.failures + 1 if before is not None else 1
        backoff = self._settings.retry_backoff_secs
        wait = min(backoff * 2 ** (failures - 1), backoff * _MAX_BACKOFF_FACTOR) if retry else float("inf")
        self._down[server.name] = _Down(time.monotonic() + wait, why, failures)
        if self._tools.pop(server.name, None):
            self.changed = True
        self._from.pop(server.name, None)
        if before is None or before.error != why:
            log.warning("%s; its tools are not offered%s", why, f" for {wait:.0f} s" if retry else "")
            data: dict[str, Any] = {"server": server.name, "error": why}
            if retry:
                data["retry_in_secs"] = round(wait, 1)
            notice("mcp_server_unavailable", data)
        return wait

    # -- resources -------------------------------------------------------------

    def _resource_tools(self, server: McpServer, names: set[str]) -> list[Tool]:
        """`list_resources` and `read_resource`, for a server that offers resources."""
        out: list[Tool] = []
        for raw, description, schema, run in (
            ("list_resources", f"List the resources of the MCP server {server.name} (their URIs, names, "
             "descriptions); pass the cursor it returns to see the next page.",
             {"type": "object", "properties": {"cursor": {"type": "string"}}}, self._list_resources(server)),
            ("read_resource", f"Read one resource of the MCP server {server.name} by its URI.",
             {"type": "object", "properties": {"uri": {"type": "string"}}, "required": ["uri"]},
             self._read_resource(server)),
        ):
            name = tool_name(server.name, raw, names)
            if name is not None:
                names.add(name)
                out.append(Tool(name, description, schema, "uri" if raw == "read_resource" else None, run))
        return out

    def _list_resources(self, server: McpServer) -> Callable[[dict[str, Any], ToolEnv], Awaitable[str]]:
        async def run(args: dict[str, Any], env: ToolEnv) -> str:
            limits = env.settings.mcp
            connection = await self._start(server, env)
            page = await connection.resources_page(args.get("cursor"), limits.call_timeout_secs,
                                                   limits.start_timeout_secs)
            lines = [json.dumps({k: v for k, v in (("uri", str(r.uri)), ("name", r.name),
                                                   ("description", r.description), ("mimeType", r.mime_type))
                                 if v}, ensure_ascii=False) for r in page.resources]
            if page.next_cursor:
                lines.append(f"(more: cursor {json.dumps(page.next_cursor)})")
            text = "\n".join(lines) or "(no resources)"
            limit = env.settings.tools.output_limit_bytes
            return text if len(text.encode()) <= limit else text.encode()[:limit].decode("utf-8", "ignore")

        return run

    def _read_resource(self, server: McpServer) -> Callable[[dict[str, Any], ToolEnv], Awaitable[str]]:
        async def run(args: dict[str, Any], env: ToolEnv) -> str:
            limits = env.settings.mcp
            connection = await self._start(server, env)
            from session_worker.agent._mcpclient import render_resource

            result = await connection.read(str(args["uri"]), limits.call_timeout_secs, limits.start_timeout_secs)
            return render_resource(result, env.settings.tools.output_limit_bytes)

        return run

    async def aclose(self) -> None:
        connections, self._connections = list(self._connections.values()), {}
        await close_all(connections)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None  # refused by schema_of, with its reason


async def _client_module() -> Any:
    """`_mcpclient`, imported on a thread the first time: the SDK's import
    takes ~0.4 s, which on the loop would delay the worker's heartbeats
    (a span of its own in a traced turn: it is the first call's time too)."""
    name = "session_worker.agent._mcpclient"
    module = sys.modules.get(name)
    if module is None:
        with tracing.span("import mcp"):
            module = await asyncio.to_thread(importlib.import_module, name)
    return module


async def close_all(connections: Sequence[McpConnection]) -> None:
    if connections:
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
