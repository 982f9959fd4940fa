"""What the daemon and the worker side agree on besides messages: exit
codes, exit reasons and limit kinds.  Both sides import this; neither
imports the other."""

from __future__ import annotations

import enum

__all__ = ["EXIT_BOOT_FAILED", "ExitReason", "LimitKind", "StopReason", "INCOMPLETE_STOPS"]

# Like gunicorn's WORKER_BOOT_ERROR: a worker that cannot boot exits with
# this, and the daemon reads it as "do not respawn in a tight loop".
EXIT_BOOT_FAILED = 3


# A worker with no turn running beats this many times more slowly (and is
# allowed as much longer a silence): at the default 1 s, every 30 s.  Each
# beat of an idle worker is a cold wake-up (~200-280 us of CPU, measured in
# bench/README.md), so 1,000 idle sessions cost 33 of them a second, not
# 1,000 (a factor of 10 left them at 2-3.5% of a core).  Nothing is lost
# by the slower beat: a loop stuck between turns harms no one until the
# next input, and an input puts the worker back at the full pace (the
# daemon's allowance restarts with the turn), so a stuck worker is still
# killed within three intervals of being asked for something.
IDLE_HEARTBEAT_FACTOR = 30


# The machines session_worker._seccomp has a syscall table for: the daemon
# says seccomp is missing elsewhere, the worker runs without it.
SECCOMP_MACHINES = ("x86_64", "amd64")


class ExitReason(enum.StrEnum):
    """Why a worker's process ended, decided once per exit (ExitInfo.reason)."""

    EXITED = "exited"  # code 0, nobody asked
    BOOT_FAILED = "boot_failed"  # never said Ready, or EXIT_BOOT_FAILED
    CRASHED = "crashed"  # a signal or a non-zero code, or killed for a broken link
    KILLED_MEMORY = "killed_memory"
    KILLED_TURN_TIMEOUT = "killed_turn_timeout"
    KILLED_HEARTBEAT = "killed_heartbeat"
    KILLED_PROCESSES = "killed_processes"  # max_processes, where the sweep counts them
    # max_disk_mb: the session is stopped (not restarted) until under it
    KILLED_DISK = "killed_disk"
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
    PROCESSES = "processes"
    DISK = "disk"  # max_disk_mb, in MiB
    # A ceiling of [agent.budget]: LimitExceeded.ceiling names it, .unit says in what.
    BUDGET = "budget"


class StopReason(enum.StrEnum):
    """TurnDone.stop_reason: why the model's last reply ended, when that was
    not a normal end.  Provider-neutral: OpenAI's `finish_reason` and
    Anthropic's `stop_reason` both map here ("" = the reply was complete)."""

    COMPLETE = ""
    # The output token limit cut the reply (OpenAI `length`, Anthropic `max_tokens`).
    TRUNCATED = "truncated"
    # The provider's content filter withheld or cut the reply (`content_filter`).
    FILTERED = "filtered"
    # The model declined to answer (Anthropic `refusal`).
    REFUSED = "refused"


# Stop reasons after which a client should not take the reply as an answer
# (`sessionctl send` exits non-zero).
INCOMPLETE_STOPS = frozenset({StopReason.TRUNCATED, StopReason.FILTERED, StopReason.REFUSED})
