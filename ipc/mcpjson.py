"""MCP servers as Claude Code, Cursor and Claude Desktop users write them:
the `mcpServers` object of a `.mcp.json` (VS Code's `servers` too), read
into `[[mcp.servers]]` tables.

Pure (the caller reads the file).  Run by the daemon: `[mcp] import`
at start and at each reload (`supervisor.config`), and `sessiond mcp
import FILE`, which prints the tables.  Here, beside the settings schema it
produces, so both read one description of the shape:

    {"mcpServers": {
        "memory": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"],
                   "env": {"MEMORY_FILE_PATH": "${HOME}/memory.json"}},
        "search": {"type": "http", "url": "https://search.example/mcp",
                   "headers": {"Authorization": "Bearer ${SEARCH_TOKEN}"}},
        "legacy": {"type": "sse", "url": "http://127.0.0.1:8931/sse"}}}

`command` and `args` become the argv; `${VAR}` and `${VAR:-default}` are
kept as written and read from the daemon's environment when a server
starts (never a client's).  An entry with `"disabled": true` is skipped;
`"lazy": false` (ours) makes a server eager.  Any other key is refused,
naming it: a setting silently dropped could be one that mattered.
"""

from __future__ import annotations

from typing import Any

__all__ = ["servers_from_json"]

_ENTRY_KEYS = frozenset({"command", "args", "env", "type", "url", "headers", "disabled", "lazy"})
_TYPES = {"stdio": "stdio", "http": "http", "streamable-http": "http", "streamableHttp": "http", "sse": "sse"}


def servers_from_json(document: Any) -> list[dict[str, Any]]:
    """The `[[mcp.servers]]` tables (plain data, for `McpServer`) of a
    parsed `.mcp.json`; ValueError saying which entry and key is wrong."""
    if not isinstance(document, dict):
        raise ValueError("expected a JSON object with an \"mcpServers\" object")
    key = "mcpServers" if "mcpServers" in document else "servers" if "servers" in document else ""
    servers = document.get(key) if key else None
    if not isinstance(servers, dict):
        raise ValueError("expected a JSON object with an \"mcpServers\" object")
    return [table for name, entry in servers.items() if (table := _table(f"{key}.{name}", name, entry))]


def _table(where: str, name: Any, entry: Any) -> dict[str, Any] | None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (sessiond reads "
                         f"{', '.join(sorted(_ENTRY_KEYS))})")
    if entry.get("disabled") is True:
        return None
    kind = entry.get("type", "")
    if kind and kind not in _TYPES:
        raise ValueError(f"{where}.type: {kind!r} is not one of {', '.join(_TYPES)}")
    table: dict[str, Any] = {"name": name}
    if "command" in entry:
        command, args = entry["command"], entry.get("args", [])
        if not isinstance(command, str) or not command:
            raise ValueError(f"{where}.command: expected a non-empty string")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"{where}.args: expected a list of strings")
        table["command"] = [command, *args]
        if "env" in entry:
            table["env"] = _strings(f"{where}.env", entry["env"])
    elif "args" in entry or "env" in entry:
        raise ValueError(f"{where}: args and env are for a command (stdio) server")
    if "url" in entry:
        table["url"] = entry["url"]
        if "headers" in entry:
            table["headers"] = _strings(f"{where}.headers", entry["headers"])
    if kind:
        table["type"] = _TYPES[kind]
    if "lazy" in entry:
        table["lazy"] = entry["lazy"]
    return table


def _strings(where: str, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"{where}: expected an object of strings")
    return dict(value)
