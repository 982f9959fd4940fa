"""The built-in tools.  Names and arguments are a contract:
`bash{command, timeout_secs?}`, `read_file{path}`, `write_file{path, content}`,
`list_dir{path}`, `spawn_agent{task, handler?}`.

File tools check a path in two layers.  First a friendly one: the path
(relative to the workspace, or absolute) is resolved with every symlink
followed and refused unless the result is the workspace or inside it; that
gives the readable error.  Then the one that holds: the resolved path is
opened relative to a directory fd of the workspace by `_beneath`, where
the kernel refuses any step out of it during the open itself, so a symlink
swapped in after the check (the session's own tools can race us) cannot
lead the open outside.  The blocking file I/O runs on a thread so that a
slow disk does not stop the worker's loop (and its heartbeats).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import session_worker.agent._beneath as _beneath
from ipc.settings import BUILTIN_TOOLS
from session_worker.agent._bash import run_bash
from session_worker.agent._errors import ToolError
from session_worker.agent._tools import Tool, ToolEnv
from session_worker.errors import SpawnError

__all__ = ["BUILTIN_NAMES", "builtin_tools", "resolve_inside"]

BUILTIN_NAMES = BUILTIN_TOOLS  # (the daemon checks tools.enabled against the same list)


def resolve_inside(workspace: Path, raw: str) -> Path:
    """`raw` resolved against the (already resolved) workspace, or ToolError."""
    if not raw or "\x00" in raw:
        raise ToolError("path must be a non-empty string without NUL bytes")
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = workspace / candidate
    try:
        real = candidate.resolve()
    except RuntimeError:
        raise ToolError(f"cannot resolve {raw!r}: a symlink loop") from None
    except OSError as exc:  # e.g. a symlink being renamed away meanwhile
        raise ToolError(f"cannot resolve {raw!r}: {exc.strerror}") from None
    if real != workspace and not real.is_relative_to(workspace):
        raise _outside(raw, workspace)
    return real


def _outside(raw: str, workspace: Path) -> ToolError:
    return ToolError(
        f"path {raw!r} resolves outside the workspace ({workspace}); "
        "only paths inside it can be used"
    )


def _escaped(exc: OSError, raw: str, workspace: Path) -> ToolError | None:
    """The readable error for an open that the kernel stopped at the
    workspace's edge (EXDEV, ELOOP), else None."""
    return _outside(raw, workspace) if exc.errno in _beneath.ESCAPE_ERRNOS else None


def _shown(path: Path, workspace: Path) -> str:
    rel = path.relative_to(workspace)
    return "." if rel == Path(".") else str(rel)


async def _bash(args: dict[str, Any], env: ToolEnv) -> str:
    cap = env.settings.tools.bash_timeout_secs
    requested = args.get("timeout_secs")
    timeout = cap if requested is None else min(max(float(requested), 0.001), cap)
    return await run_bash(
        args["command"], env.workspace, timeout, env.settings.tools.output_limit_bytes
    )


async def _read_file(args: dict[str, Any], env: ToolEnv) -> str:
    raw = args["path"]
    path = resolve_inside(env.workspace, raw)
    limit = env.settings.tools.output_limit_bytes

    def read() -> tuple[bytes, int]:
        with _beneath.root_fd(env.workspace) as root:
            return _beneath.read_beneath(root, _shown(path, env.workspace), limit + 1)

    try:
        data, size = await asyncio.to_thread(read)
    except IsADirectoryError:
        raise ToolError(f"{raw!r} is a directory; use list_dir") from None
    except FileNotFoundError:
        raise ToolError(f"no such file: {raw!r}") from None
    except OSError as exc:
        raise _escaped(exc, raw, env.workspace) or ToolError(
            f"cannot read {raw!r}: {exc.strerror}") from None
    text = data[:limit].decode("utf-8", "replace")
    if len(data) > limit:
        text += f"\n[... file truncated: showing the first {limit} of {size} bytes]"
    return text


async def _write_file(args: dict[str, Any], env: ToolEnv) -> str:
    raw = args["path"]
    path = resolve_inside(env.workspace, raw)
    data = args["content"].encode("utf-8")

    def write() -> None:
        with _beneath.root_fd(env.workspace) as root:
            _beneath.write_beneath(root, _shown(path, env.workspace), data)

    try:
        await asyncio.to_thread(write)
    except IsADirectoryError:
        raise ToolError(f"{raw!r} is a directory") from None
    except OSError as exc:
        raise _escaped(exc, raw, env.workspace) or ToolError(
            f"cannot write {raw!r}: {exc.strerror}") from None
    return f"wrote {len(data)} bytes to {_shown(path, env.workspace)}"


async def _list_dir(args: dict[str, Any], env: ToolEnv) -> str:
    raw = args["path"]
    path = resolve_inside(env.workspace, raw)

    def scan() -> list[_beneath.Entry]:
        with _beneath.root_fd(env.workspace) as root:
            return _beneath.list_beneath(root, _shown(path, env.workspace))

    try:
        entries = await asyncio.to_thread(scan)
    except NotADirectoryError:
        raise ToolError(f"{raw!r} is not a directory") from None
    except FileNotFoundError:
        raise ToolError(f"no such directory: {raw!r}") from None
    except OSError as exc:
        raise _escaped(exc, raw, env.workspace) or ToolError(
            f"cannot list {raw!r}: {exc.strerror}") from None
    lines = []
    for entry in entries:
        if entry.kind == "link":
            lines.append(f"{entry.name}@")
        elif entry.kind == "dir":
            lines.append(f"{entry.name}/")
        else:
            lines.append(f"{entry.name}\t{entry.size} bytes")
    if not lines:
        return f"{_shown(path, env.workspace)} is empty"
    text = "\n".join(lines)
    limit = env.settings.tools.output_limit_bytes
    if len(text) > limit:
        text = text[:limit] + f"\n[... listing truncated: {len(lines)} entries]"
    return text


async def _spawn_agent(args: dict[str, Any], env: ToolEnv) -> str:
    try:
        return await env.ctx.spawn_agent(args["task"], args.get("handler"))
    except SpawnError as exc:
        raise ToolError(f"the sub-agent could not run: {exc}") from None


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def builtin_tools() -> dict[str, Tool]:
    path = {"type": "string", "description": "Path relative to the workspace."}
    return {
        "bash": Tool(
            "bash",
            "Run a shell command with /bin/bash -c in the workspace directory. "
            "stdin is empty; stdout and stderr are returned together (long output "
            "is cut in the middle) with the exit code.",
            _object(
                {
                    "command": {"type": "string", "description": "The shell command."},
                    "timeout_secs": {
                        "type": "number",
                        "description": "Kill the command after this many seconds "
                        "(capped by the operator's limit).",
                    },
                },
                ["command"],
            ),
            "command",
            _bash,
        ),
        "read_file": Tool(
            "read_file",
            "Read a text file from the workspace.",
            _object({"path": path}, ["path"]),
            "path",
            _read_file,
        ),
        "write_file": Tool(
            "write_file",
            "Write a text file in the workspace, creating parent directories and "
            "replacing the file if it exists.",
            _object(
                {"path": path, "content": {"type": "string", "description": "Full file content."}},
                ["path", "content"],
            ),
            "path",
            _write_file,
        ),
        "list_dir": Tool(
            "list_dir",
            "List a directory of the workspace (use \".\" for the workspace itself). "
            "Directories end with /, symlinks with @.",
            _object({"path": path}, ["path"]),
            "path",
            _list_dir,
        ),
        "spawn_agent": Tool(
            "spawn_agent",
            "Hand a self-contained task to a sub-agent and get its final answer.",
            _object(
                {
                    "task": {"type": "string", "description": "What the sub-agent should do."},
                    "handler": {
                        "type": "string",
                        "description": "Optional handler for the sub-agent "
                        "(default: the same handler as this session).",
                    },
                },
                ["task"],
            ),
            "task",
            _spawn_agent,
        ),
    }
