"""What the daemon and the worker side agree on besides messages: exit
codes, exit reasons and limit kinds.  Both sides import this; neither
imports the other."""

from __future__ import annotations

import enum

__all__ = ["EXIT_BOOT_FAILED", "ExitReason", "LimitKind"]

# Like gunicorn's WORKER_BOOT_ERROR: a worker that cannot boot exits with
# this, and the daemon reads it as "do not respawn in a tight loop".
EXIT_BOOT_FAILED = 3


class ExitReason(enum.StrEnum):
    """Why a worker's process ended, decided once per exit (ExitInfo.reason)."""

    EXITED = "exited"  # code 0, nobody asked
    BOOT_FAILED = "boot_failed"  # never said Ready, or EXIT_BOOT_FAILED
    CRASHED = "crashed"  # a signal or a non-zero code, or killed for a broken link
    KILLED_MEMORY = "killed_memory"
    KILLED_TURN_TIMEOUT = "killed_turn_timeout"
    KILLED_HEARTBEAT = "killed_heartbeat"
    STOPPED = "stopped"  # stopped, hibernated or removed on purpose


class LimitKind(enum.StrEnum):
    """LimitExceeded.kind: which limit a session reached."""

    MEMORY = "memory"
    MEMORY_HIGH = "memory_high"
    TURN_TIMEOUT = "turn_timeout"
    HEARTBEAT = "heartbeat"
    RESTARTS = "restarts"
    TURNS = "turns"
    TOOL_CALLS = "tool_calls"
