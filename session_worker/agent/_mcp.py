"""MCP servers' tools, as tools of the session's registry.

Runs in the worker.  The operator lists servers (`[[mcp.servers]]`,
`ipc.settings.McpServer`); a session is offered `mcp.offered()`, which a
per-session override may only narrow.  At the start of a turn the handler
asks `McpTools.discover` for the tools of every offered server not listed
yet: each is connected (`_mcpclient`: a stdio server started in the
session's sandbox, an HTTP one reached by the worker) and its tools become
`Tool`s named `mcp__<server>__<tool>` (the naming Claude Code uses), which
enter the same `ToolRegistry` as the built-ins.  From there the loop treats
them as any tool: argument checks, permission rules by name and main
argument, the output cap, the `tool_call`/`tool_result` notices, the same
errors-as-results.  A server that cannot be reached is reported
(`mcp_server_unavailable` notice, a log line) and tried again next turn;
its tools are simply not offered meanwhile.

What a server lists is hostile input: a name that does not fit the
providers' tool-name rule (`^[A-Za-z0-9_-]{1,64}$`) is rewritten to one that
does, with a digest of the original that keeps it unique (calls still go
out under the server's own name); a name past 256 characters, a schema that
is not a JSON object schema or is over 16 KiB, and tools past 128 per
server are refused (`mcp_tools_refused` notice); a description is cut to
2 KiB.  The SDK itself is imported only when there is a server to connect.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import logging
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from session_worker.agent._errors import McpServerError, ToolError
from session_worker.agent._tools import Tool, ToolEnv
from ipc.install import install_command
from ipc.settings import McpServer, McpSettings

if TYPE_CHECKING:
    from session_worker.agent._mcpclient import ListedTool, McpConnection

__all__ = ["McpTools", "adapt_tool", "close_all", "tool_name"]

log = logging.getLogger("sessiond.mcp")

PREFIX = "mcp__"
_NAME_RULE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_NAME = 64
_MAX_SOURCE_NAME = 256
_MAX_DESCRIPTION_CHARS = 2048
_MAX_SCHEMA_BYTES = 16 * 1024
_MAX_TOOLS_PER_SERVER = 128

Notify = Callable[[str, dict[str, Any]], None]


def tool_name(server: str, raw: str, taken: set[str] | frozenset[str] = frozenset()) -> str | None:
    """The name the model sees for `raw` of `server`, or None (refused)."""
    if not isinstance(raw, str) or not raw or len(raw) > _MAX_SOURCE_NAME:
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


def _schema(raw: Any) -> dict[str, Any] | str:
    """The input schema as the model gets it, or why it is refused."""
    if not isinstance(raw, dict) or raw.get("type", "object") != "object":
        return "its input schema is not a JSON object schema"
    try:
        text = json.dumps(raw, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return "its input schema is not JSON"
    if len(text.encode()) > _MAX_SCHEMA_BYTES:
        return f"its input schema is over {_MAX_SCHEMA_BYTES} bytes"
    schema: dict[str, Any] = json.loads(text)
    schema["type"] = "object"
    properties = schema.setdefault("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(r, str) for r in required):
        return "its input schema's properties or required list is malformed"
    return schema


def _description(raw: str) -> str:
    text = raw.strip() if isinstance(raw, str) else ""
    if len(text) > _MAX_DESCRIPTION_CHARS:
        text = text[:_MAX_DESCRIPTION_CHARS] + " [description cut]"
    return text


def adapt_tool(server: str, connection: Callable[[], McpConnection], listed: ListedTool,
               taken: set[str]) -> Tool | str:
    """A registry Tool calling `listed` on `server`, or why it is refused."""
    name = tool_name(server, listed.name, taken)
    if name is None:
        return "its name is empty, over 256 characters, or cannot be made unique"
    schema = _schema(listed.schema)
    if isinstance(schema, str):
        return schema
    required = schema.get("required") or []
    main_arg = required[0] if required else next(iter(schema["properties"]), None)
    description = _description(listed.description) or f"Tool {listed.name} of the MCP server {server}."
    source = listed.name

    async def run(args: dict[str, Any], env: ToolEnv) -> str:
        from session_worker.agent._mcpclient import render_result

        limits = env.settings.mcp
        result = await connection().call(source, args, limits.call_timeout_secs, limits.start_timeout_secs)
        is_error, text = render_result(result, env.settings.tools.output_limit_bytes)
        if is_error:
            raise ToolError(f"{name} reported an error: {text}")
        return text

    return Tool(name, description, schema, main_arg, run)


class McpTools:
    """The MCP servers of one session and the tools they listed."""

    def __init__(self, settings: McpSettings, workspace: Path) -> None:
        self._workspace = workspace
        self._servers: list[McpServer] = settings.offered()
        self._start_timeout = settings.start_timeout_secs
        self._connections: dict[str, McpConnection] = {}
        self._tools: dict[str, list[Tool]] = {}

    def tools(self) -> list[Tool]:
        """Listed so far, in the operator's order of servers."""
        return [tool for server in self._servers for tool in self._tools.get(server.name, ())]

    def reconfigure(self, settings: McpSettings) -> list[McpConnection]:
        """New settings: servers no longer offered, or changed, are dropped
        (their connections returned, for the caller to close); new ones
        are listed at the next `discover`."""
        servers = settings.offered()
        kept = {s.name for s in servers} & {s.name for s in self._servers if s in servers}
        dropped = [c for name, c in self._connections.items() if name not in kept]
        self._connections = {n: c for n, c in self._connections.items() if n in kept}
        self._tools = {n: t for n, t in self._tools.items() if n in kept}
        self._servers = servers
        self._start_timeout = settings.start_timeout_secs
        return dropped

    async def discover(self, notice: Notify, taken: Sequence[str] = ()) -> bool:
        """List the tools of every offered server not listed yet; True when
        the set of tools changed.  `taken`: names of the other tools."""
        pending = [s for s in self._servers if s.name not in self._tools]
        if not pending:
            return False
        try:
            await _client_module()  # once, before the servers connect side by side
        except ImportError as exc:
            why = f"the MCP SDK cannot be imported ({exc}): {install_command('mcp')}"
            log.warning("%s; no MCP server's tools are offered", why)
            for server in pending:
                notice("mcp_server_unavailable", {"server": server.name, "error": why})
            return False
        outcomes = await asyncio.gather(*(self._list(s) for s in pending), return_exceptions=True)
        names = set(taken) | {t.name for t in self.tools()}
        changed = False
        for server, outcome in zip(pending, outcomes):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                why = str(outcome) if isinstance(outcome, McpServerError) else (
                    f"MCP server {server.name!r} failed: {type(outcome).__name__}: {outcome}")
                log.warning("%s; its tools are not offered this turn", why)
                notice("mcp_server_unavailable", {"server": server.name, "error": why})
                continue
            tools, refused = self._adapt(server.name, outcome, names)
            self._tools[server.name] = tools
            changed = changed or bool(tools)
            log.info("MCP server %s: %d tool(s)%s", server.name, len(tools),
                     f", {len(refused)} refused" if refused else "")
            if refused:
                notice("mcp_tools_refused", {"server": server.name, "tools": refused})
        return changed

    async def _list(self, server: McpServer) -> list[ListedTool]:
        connection = self._connections.get(server.name)
        if connection is None:
            client = await _client_module()
            connection = self._connections[server.name] = client.McpConnection(server, self._workspace)
        return await connection.list_tools(self._start_timeout)

    def _adapt(self, server: str, listed: list[ListedTool], names: set[str]) -> tuple[list[Tool], list[dict[str, str]]]:
        tools: list[Tool] = []
        refused: list[dict[str, str]] = []

        def connection() -> McpConnection:
            found = self._connections.get(server)
            if found is None:
                raise McpServerError(f"MCP server {server!r} is no longer offered to this session")
            return found

        for item in listed:
            shown = repr(item.name)[:80] if isinstance(item.name, str) else "?"
            if len(tools) >= _MAX_TOOLS_PER_SERVER:
                refused.append({"tool": shown, "reason": f"more than {_MAX_TOOLS_PER_SERVER} tools"})
                continue
            tool = adapt_tool(server, connection, item, names)
            if isinstance(tool, str):
                refused.append({"tool": shown, "reason": tool})
                continue
            names.add(tool.name)
            tools.append(tool)
        return tools, refused

    async def aclose(self) -> None:
        connections, self._connections = list(self._connections.values()), {}
        await close_all(connections)


async def _client_module() -> Any:
    """`_mcpclient`, imported on a thread the first time: the SDK's import
    takes ~0.4 s, which on the loop would delay the worker's heartbeats."""
    name = "session_worker.agent._mcpclient"
    module = sys.modules.get(name)
    if module is None:
        module = await asyncio.to_thread(importlib.import_module, name)
    return module


async def close_all(connections: Sequence[McpConnection]) -> None:
    if connections:
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
