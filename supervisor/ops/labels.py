"""Bounded words for what happened: why a turn failed, a provider's status,
what kind of tool a call was and how it went, which limit killed a worker.

Pure; runs in the daemon (the metrics' labels, the traces' `error.type`)
and is imported by the span exporter process with `otel.py`, so it imports
nothing of the daemon's.  What a worker says is hostile: each function maps
any text to one of a fixed set, so no label or attribute grows with the
input.
"""

from __future__ import annotations

import re

from ipc.contract import ExitReason, LimitKind

__all__ = ["FAILURE_KINDS", "PROVIDER_STATUSES", "TOOL_KINDS", "TOOL_OUTCOMES", "failure_kind", "killed_by",
           "provider_status", "tool_kind", "tool_outcome"]

# Why a turn failed.  A worker's death reads
# "killed_memory: ... (signal SIGKILL)" (supervisor.core.exits.describe_exit):
# its ExitReason.  Otherwise the first rule whose words are in the reason
# wins; the texts come from supervisor.core.ledger, .workers and the agent loop.
_FAILURE_WORDS = (
    ("the session was ", "stopped"), ("stopped during this turn", "daemon_restart"),
    ("LLM provider error", "provider"), ("could not be saved", "store"), ("internal error", "internal"),
)
_EXIT_REASONS = frozenset(ExitReason.__members__.values())
FAILURE_KINDS = tuple(dict.fromkeys((*ExitReason, *(kind for _, kind in _FAILURE_WORDS), "handler")))
_HTTP_STATUS = re.compile(r"\bHTTP ([1-5][0-9][0-9])\b")
# The statuses a provider is known to answer with when it fails (a series
# each from the start); any other three digits still count, as their own.
PROVIDER_STATUSES = ("none", "400", "401", "403", "404", "408", "409", "413", "429", "500", "502", "503",
                     "504", "529")

# The agent's tools by kind (session_worker/agent/_builtins.py; MCP tools are
# named mcp__SERVER__TOOL); "custom": the operator's own tools, and any name
# the daemon does not know.
_TOOL_KINDS = {"bash": "bash", "read_file": "file", "write_file": "file", "list_dir": "file",
               "spawn_agent": "spawn_agent"}
TOOL_KINDS = ("bash", "file", "spawn_agent", "mcp", "custom")
# How a tool call went: "denied" by a rule or a person, "error" for any other
# failure the model was told of (the tool's own, a bad call, a kill).
TOOL_OUTCOMES = ("ok", "error", "denied")

# The limit a kill of this kind enforces (its LimitKind), for a tool that
# died with its worker.
_KILLED_BY = {
    ExitReason.KILLED_MEMORY: LimitKind.MEMORY, ExitReason.KILLED_TURN_TIMEOUT: LimitKind.TURN_TIMEOUT,
    ExitReason.KILLED_HEARTBEAT: LimitKind.HEARTBEAT, ExitReason.KILLED_PROCESSES: LimitKind.PROCESSES,
    ExitReason.KILLED_DISK: LimitKind.DISK,
}


def failure_kind(reason: str) -> str:
    """`reason` as one of FAILURE_KINDS ("handler": the handler failed the
    turn, or raised, in words of its own)."""
    head = reason.partition(":")[0].partition(" (")[0]
    if head in _EXIT_REASONS:
        return head
    for words, kind in _FAILURE_WORDS:
        if words in reason:
            return kind
    return "handler"


def killed_by(reason: str) -> str:
    """The limit (a LimitKind) whose kill `reason` (a failure's words)
    says the worker died of; "" for a death no limit caused."""
    limit = _KILLED_BY.get(ExitReason(kind)) if (kind := failure_kind(reason)) in _EXIT_REASONS else None
    return str(limit) if limit is not None else ""


def provider_status(error: str) -> str:
    """The HTTP status in a provider error's text ("provider answered HTTP
    429: ..."), or "none" (connection refused, timeout, a broken stream)."""
    found = _HTTP_STATUS.search(error)
    return found.group(1) if found else "none"


def tool_kind(name: str) -> str:
    """A tool's name as one of TOOL_KINDS."""
    if name.startswith("mcp__"):
        return "mcp"
    return _TOOL_KINDS.get(name, "custom")


def tool_outcome(ok: bool, output: str) -> str:
    """A tool call's result as one of TOOL_OUTCOMES (the agent loop's words:
    "error: permission denied: ...")."""
    if ok:
        return "ok"
    return "denied" if output.startswith("error: permission denied") else "error"
