"""MCP servers as every side sees them: a server's tool list as the daemon
keeps it for its sessions, `${VAR}` expansion, and which tools a
permission rule's `tool` names.

Pure, no I/O.  Used by the daemon (its tool-list cache,
`supervisor.core.mcpcatalog`; `config check`), by the process that lists a
server's tools for it (`session_worker.mcplist`) and by the worker
(`session_worker.agent._mcp`, `_mcpclient`, `_permissions`).

**The listing.**  The daemon lists each lazy server once (per its table's
`key` and the version it answers with) and tells every session the result
in its settings (`McpSettings.listed`): a session offers those tools
without starting anything, and starts its own copy of the server at the
first call.  What a server lists is hostile input, bounded here by the
same figures the worker checks its own listings against: 128 tools, a name
of 256 characters, a description of 2 KiB, an input schema of 16 KiB, and
256 KiB for a server's whole list (`bounded`: every session carries it);
the daemon decodes the lister's answer with these bounds before anything
is kept.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "ListedTool", "McpListing", "RefusedTool", "MAX_DESCRIPTION_CHARS", "MAX_SCHEMA_BYTES", "MAX_SOURCE_NAME",
    "MAX_LISTING_CHARS", "MAX_TOOLS_PER_SERVER", "PREFIX", "bounded", "expand", "listing_key", "rule_covers",
    "rule_problem", "variables",
]

PREFIX = "mcp__"
MAX_TOOLS_PER_SERVER = 128
MAX_SOURCE_NAME = 256
MAX_DESCRIPTION_CHARS = 2048
MAX_SCHEMA_BYTES = 16 * 1024
# All of one server's list the daemon tells every session: its tools past
# this are refused (each session holds the lists in its settings).
MAX_LISTING_CHARS = 256 * 1024
_MAX_ERROR_CHARS = 4096


class ListedTool(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One tool as its server listed it (name and schema still the
    server's: the worker makes the name the model sees, `_mcp.tool_name`)."""

    name: Annotated[str, Meta(min_length=1, max_length=MAX_SOURCE_NAME)]
    description: Annotated[str, Meta(max_length=MAX_DESCRIPTION_CHARS + 32)]
    # The input schema as JSON text: decoded by a session only when it
    # builds its tools, so an idle worker holds a string, not a tree.
    schema: Annotated[str, Meta(max_length=MAX_SCHEMA_BYTES)]


class RefusedTool(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    tool: Annotated[str, Meta(max_length=100)]
    reason: Annotated[str, Meta(max_length=200)]


ListingState = Literal["pending", "listed", "unavailable"]


class McpListing(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What the daemon knows of one lazy server's tools (`mcp.listed`)."""

    name: Annotated[str, Meta(max_length=24)]
    # `listing_key` of the server's table it was made for: a session uses
    # it only for a server configured exactly so.
    key: Annotated[str, Meta(max_length=64)]
    # pending: not listed yet (a session waits for it, up to
    # start_timeout_secs); listed; unavailable: it could not be listed
    # (`error`), tried again after a backoff.
    state: ListingState = "pending"
    version: Annotated[str, Meta(max_length=128)] = ""
    tools: Annotated[list[ListedTool], Meta(max_length=MAX_TOOLS_PER_SERVER)] = []
    refused: Annotated[list[RefusedTool], Meta(max_length=2 * MAX_TOOLS_PER_SERVER)] = []
    # It offers resources (resources/list, resources/read): the session
    # adds a tool to list them and one to read one.
    resources: bool = False
    error: Annotated[str, Meta(max_length=_MAX_ERROR_CHARS)] = ""


def bounded(listing: McpListing) -> McpListing:
    """`listing` with its tools past MAX_LISTING_CHARS refused (in order)."""
    total, kept = 0, []
    refused = list(listing.refused)
    for tool in listing.tools:
        total += len(tool.name) + len(tool.description) + len(tool.schema)
        if total > MAX_LISTING_CHARS:
            refused.append(RefusedTool(repr(tool.name)[:80], f"the server's list is over {MAX_LISTING_CHARS} characters"))
        else:
            kept.append(tool)
    if len(kept) == len(listing.tools):
        return listing
    return msgspec.structs.replace(listing, tools=kept, refused=refused[:2 * MAX_TOOLS_PER_SERVER])


def listing_key(table: msgspec.Struct) -> str:
    """A digest of a server's table as configured (before expansion): a
    listing is kept for that table only."""
    return hashlib.sha256(msgspec.msgpack.encode(table)).hexdigest()[:32]


# ---------------------------------------------------------------- ${VAR}

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}")


def expand(text: str, environ: Mapping[str, str]) -> str:
    """`${VAR}` and `${VAR:-default}` in `text`, from `environ` (the
    daemon's environment: its EnvironmentFile), as a shell and Claude Code
    read them: the default when VAR is unset or empty.  KeyError naming
    VAR when it is unset and has no default."""
    def one(found: re.Match[str]) -> str:
        name, default = found.group(1), found.group(3)
        value = environ.get(name)
        if value:
            return value
        if default is not None:
            return default
        if value is not None:
            return value
        raise KeyError(name)

    return _VARIABLE.sub(one, text) if "${" in text else text


def variables(texts: Iterable[str]) -> list[tuple[str, bool]]:
    """(name, has a default) of every `${...}` in `texts`."""
    return [(f.group(1), f.group(2) is not None) for text in texts for f in _VARIABLE.finditer(text)]


# ---------------------------------------------------------------- rules

def rule_covers(pattern: str, tool: str) -> bool:
    """Whether a permission rule's `tool` names `tool`.  The shapes: `*`
    (every tool), a name (that tool; never a glob), and Claude Code's two
    for an MCP server's tools, `mcp__SERVER` and `mcp__SERVER__*` (every
    tool of that server)."""
    if pattern == "*" or pattern == tool:
        return True
    server = _server_shape(pattern)
    return server is not None and tool.startswith(f"{PREFIX}{server}__")


def _server_shape(pattern: str) -> str | None:
    """SERVER of `mcp__SERVER` or `mcp__SERVER__*`, else None."""
    if not pattern.startswith(PREFIX):
        return None
    rest = pattern[len(PREFIX):]
    rest = rest[:-3] if rest.endswith("__*") else rest
    return rest if rest and "__" not in rest and "*" not in rest else None


def rule_problem(pattern: str, tools: Iterable[str], servers: Iterable[str]) -> str:
    """Why a rule's `tool` can never match a tool of this configuration
    ('' when it can): `tools` are the built-in and custom tools, `servers`
    the MCP servers' names (whose tools are not known until listed)."""
    names, servers = list(tools), list(servers)
    if pattern == "*" or pattern in names:
        return ""
    if pattern.startswith(PREFIX):
        server = pattern[len(PREFIX):].partition("__")[0]
        if server not in servers:
            return f"no MCP server named {server!r} is configured" + _known(names, servers)
        if _server_shape(pattern) == server or (len(pattern) > len(f"{PREFIX}{server}__") and "*" not in pattern):
            return ""
        return "expected mcp__SERVER, mcp__SERVER__* or mcp__SERVER__TOOL"
    if "*" in pattern:
        return "a tool's name is not a glob: * alone is every tool, mcp__SERVER__* every tool of a server"
    return "no tool has this name" + _known(names, servers)


def _known(names: list[str], servers: list[str]) -> str:
    tools = ", ".join(names) or "none"
    mcp = ", ".join(f"{PREFIX}{s}" for s in servers) or "none"
    return f" (tools: {tools}; MCP servers: {mcp})"
