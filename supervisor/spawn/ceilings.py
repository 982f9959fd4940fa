"""The ceilings the daemon lives under, and each user's share of them.

A unit caps everything its processes do together: the shipped unit's
`TasksMax=4096` is the `pids.max` of its cgroup, `MemoryMax=80%` its
`memory.max` (v2) or `memory.limit_in_bytes` (v1).  The daemon reads them
from its own cgroup upwards (the smallest limit on the way to the root
counts: the hierarchy enforces every level), else the kernel's own: its
task table (`kernel.pid_max`, `kernel.threads-max`), the host's memory.

Each user's share (`[daemon] max_processes_per_uid`, `max_memory_mb_per_uid`,
set at the per-user level of the sessions' cgroups, `u-UID`) is below
them, so that no user alone can reach the unit's ceiling: 0 (the default)
takes half, as `max_live_sessions_per_uid` takes half of the live slots.

Read once at start (`read_ceilings`); `user_shares` and `fork_refusal` are
pure.  Runs in the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import NamedTuple

from supervisor.spawn.cgroups import Shares, cgroup_mounts, own_cgroups

__all__ = ["MIB", "Ceiling", "Ceilings", "Shares", "fork_refusal", "read_ceilings", "user_shares"]

MIB = 1 << 20
# cgroup v1 writes "no limit" as the largest page-aligned count (2^63 - 4096).
_UNLIMITED = 1 << 62


class Ceiling(NamedTuple):
    limit: int  # tasks, or bytes
    where: str  # the file (or sysctl) that sets it


class Ceilings(NamedTuple):
    tasks: Ceiling
    memory: Ceiling


def _read_limit(path: Path) -> int | None:
    """A cgroup limit file's value; None for none ("max", v1's huge number)
    or a file that is not there."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    with contextlib.suppress(ValueError):
        value = int(text)
        return value if value < _UNLIMITED else None
    return None


def _smallest(controller: str, names: tuple[str, ...]) -> Ceiling | None:
    """The smallest limit in `names` from our cgroup up to the hierarchy's
    root, in the hierarchy that has the controller (v2, else v1); None
    where none is set."""
    mounts, own = cgroup_mounts(), own_cgroups()
    for key in ("", controller):
        if key not in mounts or key not in own:
            continue
        point, root = mounts[key]
        if key == "" and controller not in _v2_controllers(point):
            continue
        path = own[key]
        if not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue
        here = point / path[len(root):].lstrip("/")
        found: Ceiling | None = None
        for level in [here, *here.parents]:
            for name in names:
                value = _read_limit(level / name)
                if value is not None and (found is None or value < found.limit):
                    found = Ceiling(value, str(level / name))
            if level == point:
                break
        return found
    return None


def _v2_controllers(point: Path) -> list[str]:
    try:
        return (point / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def _sysctl(name: str) -> int | None:
    try:
        return int(Path("/proc/sys", *name.split(".")).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_ceilings() -> Ceilings:
    """The daemon's task and memory ceilings, as its cgroups (else the
    kernel) set them now."""
    tasks = _smallest("pids", ("pids.max",))
    if tasks is None:
        kernel = [v for v in (_sysctl("kernel.pid_max"), _sysctl("kernel.threads-max")) if v]
        tasks = Ceiling(min(kernel) if kernel else 32768, "the kernel's task table (kernel.pid_max, kernel.threads-max)")
    memory = _smallest("memory", ("memory.max", "memory.limit_in_bytes"))
    if memory is None:
        memory = Ceiling(_mem_total(), "the host's memory (MemTotal)")
    return Ceilings(tasks, memory)


def user_shares(max_processes_per_uid: int, max_memory_mb_per_uid: int, ceilings: Ceilings) -> Shares:
    """One uid's share: what the operator set, else (0) half of the ceiling
    (never less than one worker's worth: 64 tasks, 64 MiB)."""
    processes = max_processes_per_uid or max(64, ceilings.tasks.limit // 2)
    memory = max_memory_mb_per_uid or max(64, ceilings.memory.limit // 2 // MIB)
    return Shares(processes, memory)


def fork_refusal(code: int, why: str, ceilings: Ceilings | None = None) -> str:
    """What a create is told when no worker could be forked (the zygote's
    `SpawnFailed`): which ceiling, and that it is one."""
    found = ceilings or read_ceilings()
    if code == errno.EAGAIN:
        tasks = found.tasks
        return (f"no worker can be started now: the daemon's task ceiling is reached ({why}; "
                f"{tasks.limit} tasks, {tasks.where}: the unit's TasksMax=, or RLIMIT_NPROC); "
                "running sessions are not affected; try again when some have ended")
    if code == errno.ENOMEM:
        memory = found.memory
        return (f"no worker can be started now: out of memory ({why}; the daemon's memory ceiling is "
                f"{memory.limit // MIB} MiB, {memory.where}: the unit's MemoryMax=); running sessions are "
                "not affected; try again when some have ended")
    return f"no worker can be started now: {why}" + (f" ({os.strerror(code)})" if code and os.strerror(code) not in why else "")
