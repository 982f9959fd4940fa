"""What the daemon and the worker side agree on besides messages: exit
codes, exit reasons and limit kinds.  Both sides import this; neither
imports the other."""

from __future__ import annotations

import enum

__all__ = ["BTRFS_SUBVOLUME_IOCTLS", "EXIT_BOOT_FAILED", "ExitReason", "LimitKind", "LIST_PAGE_MAX",
           "NODE_LOST_PREFIX", "PERMISSION_ANSWERED", "figure_past", "SESSION_STATES", "StopReason",
           "INCOMPLETE_STOPS", "limit_text"]

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


# The machines session_worker.worker._seccomp has a syscall table for: the daemon
# says seccomp is missing elsewhere, the worker runs without it.
SECCOMP_MACHINES = ("x86_64", "amd64")

# btrfs's ioctls that make or destroy a subvolume or a snapshot
# (linux/btrfs.h: SNAP_CREATE, SUBVOL_CREATE, SNAP_DESTROY and their _V2).
# A subvolume made inside a workspace is outside the workspace's qgroup
# limit (supervisor.host.btrfs makes each workspace one): tools' seccomp
# filter refuses these.
BTRFS_SUBVOLUME_IOCTLS = (0x50009401, 0x5000940E, 0x5000940F, 0x50009417, 0x50009418, 0x5000943F)


class ExitReason(enum.StrEnum):
    """Why a worker's process ended, decided once per exit (ExitInfo.reason)."""

    EXITED = "exited"  # code 0, nobody asked
    BOOT_FAILED = "boot_failed"  # never said Ready (it exits EXIT_BOOT_FAILED, or dies first)
    CRASHED = "crashed"  # a signal or a non-zero code, or killed for a broken link
    KILLED_MEMORY = "killed_memory"
    KILLED_TURN_TIMEOUT = "killed_turn_timeout"
    KILLED_HEARTBEAT = "killed_heartbeat"
    KILLED_PROCESSES = "killed_processes"  # max_processes, where the sweep counts them
    # max_disk_mb or max_disk_inodes (measured): the session is stopped (not
    # restarted) until under it
    KILLED_DISK = "killed_disk"
    STOPPED = "stopped"  # stopped, hibernated or removed on purpose
    # Cluster mode: lost with its machine (its node host's stream broke, or
    # it did not carry out a kill in time); whatever was tried first (a
    # kill for missed heartbeats: the silence was the node's loss).
    NODE_LOST = "node_lost"


# How a spawner words a worker lost with its node (`on_worker_lost`'s
# detail begins so); the exit is then NODE_LOST, its detail the rest.
NODE_LOST_PREFIX = "node_lost: "


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
    DISK_INODES = "disk_inodes"  # max_disk_inodes, in files (and directories)
    # A ceiling of [agent.budget]: LimitExceeded.ceiling names it, .unit says in what.
    BUDGET = "budget"


# Notice.kind of a permission request's answer: data {"request_id", "tool",
# "allowed", "uid", "client", "at"} (who answered: the connection's uid and
# the client name its Hello gave; unix time).
PERMISSION_ANSWERED = "permission_answered"


# Units of LimitExceeded.value and .limit, by kind (what `limit_text` prints).
_LIMIT_UNITS = {
    LimitKind.MEMORY: "MiB", LimitKind.MEMORY_HIGH: "MiB", LimitKind.DISK: "MiB",
    LimitKind.TURN_TIMEOUT: "s", LimitKind.HEARTBEAT: "s",
    LimitKind.RESTARTS: "restarts", LimitKind.TURNS: "model calls", LimitKind.TOOL_CALLS: "tool calls",
    LimitKind.PROCESSES: "processes", LimitKind.DISK_INODES: "files",
}
def figure_past(value: float, limit: float) -> str:
    """`value`, measured, with the fewest decimals (up to 3) that show it
    past `limit`: the words "exceeded at 64.3 MiB" never read "at 64"."""
    for digits in range(4):
        shown = f"{value:.{digits}f}"
        if float(shown) > limit:
            return shown
    return f"{value:.3f}"


# A counted unit of one.
_ONE = {"restarts": "restart", "model calls": "model call", "tool calls": "tool call", "processes": "process"}
# Kinds whose figures are whole counts; the others are measured (one decimal).
_COUNTED = frozenset({LimitKind.RESTARTS, LimitKind.TURNS, LimitKind.TOOL_CALLS, LimitKind.PROCESSES,
                      LimitKind.DISK_INODES})


def limit_text(kind: str, value: float, limit: float, ceiling: str = "", unit: str = "") -> str:
    """A LimitExceeded's figures with their unit: `64.3 MiB > 64 MiB`
    (measured), `26 > 25 model calls` (counted), and where the figure is
    not past the limit as shown, the limit reached: `64 MiB reached` (the
    kernel's cap met: a cgroup's usage stops at its limit), `3 model calls
    reached` (the last call allowed made), never `64.0 MiB > 64 MiB`; a
    budget's, reached at its ceiling and not only past it, with the
    ceiling's name: `agent.budget.session_max_output_tokens = 50 tokens:
    50 tokens spent`."""
    if ceiling:
        return f"{ceiling} = {limit:g} {unit}: {value:g} {unit} spent"
    unit = _LIMIT_UNITS.get(kind)  # type: ignore[call-overload]
    suffix = f" {unit}" if unit else ""
    shown = f"{value:.0f}" if kind in _COUNTED else f"{value:.1f}"
    if float(shown) > limit:
        return f"{shown} > {limit:g}{suffix}" if kind in _COUNTED else f"{shown}{suffix} > {limit:g}{suffix}"
    if value >= limit:
        if limit == 1 and unit in _ONE:
            suffix = f" {_ONE[unit]}"
        return f"{limit:g}{suffix} reached"
    return f"{shown}{suffix} of {limit:g}{suffix}"


# The session states (supervisor.core.states.State, which a test holds to
# this list): what `ls --state` and the bulk commands' `--state` accept.
SESSION_STATES = ("starting", "idle", "running", "interrupting", "stopping", "stopped", "crashed",
                  "restarting", "failed", "hibernated", "deleted", "damaged")

# The most sessions one page of `ls` holds (List.limit): the daemon refuses
# more, sessionctl's --limit says so first.
LIST_PAGE_MAX = 10_000


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
