"""A cgroup per session, where the kernel offers one the daemon may manage:
what a cgroup gives, which kind is used where, and the one interface the
callers see.  Runs in the daemon only.

Each session's worker is put in a cgroup of its own before it runs any
handler code, and everything it and its tools start stays there, whatever
it does to leave the worker's tree (setsid, daemon(3), a user and PID
namespace of its own):

- the kill is complete: every process of the session dies with it;
- the memory cap is the kernel's (`max_memory_mb`), counted at allocation
  time and counting what the session wrote to tmpfs, memfds and the page
  cache, not one poll later; a session at its cap with nothing left to
  reclaim is killed whole, classified `killed_memory` as the sweep's kill;
- `max_processes` is the kernel's pids limit: a fork bomb stops at it;
- the session's CPU weight is below the daemon's (`[daemon] session_nice`),
  one weight per uid above the sessions (`u-UID/s-ID`), so one user's many
  sessions share one user's share;
- each owner uid's share of the daemon's ceilings (`supervisor.spawn.ceilings`)
  is the kernel's at that `u-UID` level: `pids.max` = `max_processes_per_uid`,
  the memory limit = `max_memory_mb_per_uid`, so that no user alone reaches
  the unit's `TasksMax` or `MemoryMax`; a create is refused while its owner
  is at its share of tasks (`user_room`), and an OOM kill is told by the
  ceiling that caused it (`oom_cause`: the session's own cap, its user's
  share, or the daemon's own ceiling, the unit's).

`supervisor.spawn.cgroups_detect` (`[daemon] cgroups = "auto"`) takes, in order:

1. a delegated cgroup v2 subtree (systemd `Delegate=yes`): `cgroups_v2`;
2. as root, writable cgroup v1 `memory` and `pids` hierarchies (with `cpu`
   and `freezer` when mounted): `cgroups_v1`;
3. none: the tool host and the zygote contain processes, RLIMIT_NPROC and
   the memory sweep enforce the limits (what `detect` returns says why).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

log = logging.getLogger("sessiond")

__all__ = ["Cgroups", "OomCause", "OomMark", "OomWatch", "Shares", "cgroup_mounts", "flat_key", "nice_weight", "own_cgroups",
           "remove_empty", "room_left", "within_share"]

# Which ceiling an OOM kill in a session's cgroup was for: its own cap
# (max_memory_mb), its owner's share (max_memory_mb_per_uid), or the daemon's
# own ceiling (the unit's MemoryMax, the host's memory).
OomCause = Literal["own", "user", "unit"]
# Tasks a new worker needs in its owner's share: itself, a tool host, a
# command (a create is refused with fewer left).
_WORKER_TASKS = 8


class Shares(NamedTuple):
    """One owner uid's share of what the daemon's ceilings allow."""

    processes: int  # tasks (processes and threads)
    memory_mb: int


class OomMark(NamedTuple):
    """A session's OOM counters when its worker was attached: what is more
    later is this worker's (see Cgroups.oom_cause)."""

    own: int = 0  # v2: memory.events `oom` of the session's cgroup
    user: int = 0  # v2: the same of its u-UID
    kills: int = 0  # the kernel's OOM kills of the session's processes


def within_share(max_processes: int | None, share: Shares | None) -> int | None:
    """A session's pids.max: never above its owner's share."""
    if share is None:
        return max_processes
    return min(max_processes, share.processes) if max_processes else share.processes


def room_left(current: int | None, limit: int | None, uid: int | None) -> str:
    """'' when a uid's share of tasks has room for one more worker, else
    why not (pure)."""
    if current is None or limit is None or current + _WORKER_TASKS <= limit:
        return ""
    return (f"uid {uid} holds {current} tasks (processes and threads) of its share of {limit} "
            "([daemon] max_processes_per_uid); try again when some of its sessions' processes have ended")

# The kernel's weight of a task at each nice level (sched_prio_to_weight,
# nice 0..19): the share a cgroup gets at the weight of one such task.
_NICE_WEIGHT = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
                110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


def flat_key(path: Path, key: str) -> int:
    """A "key N" line of a flat-keyed cgroup file, or 0."""
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


def remove_empty(cg: Path, stop: Callable[[Path], bool]) -> None:
    """Remove a session's cgroup and then its u-UID parent, while empty;
    never a directory `stop` names (the daemon's own levels)."""
    for d in (cg, cg.parent):
        if stop(d):
            return
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            # EBUSY: processes still dying (a kill is asynchronous), or
            # (u-UID) another session of the uid: the next release retries.
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                log.warning("cannot remove cgroup %s: %s", d, exc.strerror)
            return


def nice_weight(nice: int) -> int:
    """The CPU weight (v1 `cpu.shares` scale: nice 0 is 1024) of nice `nice`."""
    return _NICE_WEIGHT[max(0, min(nice, 19))]


class Cgroups(abc.ABC):
    """A cgroup per session: what the workers' owner, the sweep and `stats`
    use, whichever kernel interface is behind it."""

    version: int
    # The controllers in use, of "memory", "pids", "cpu" (and "freezer" in v1).
    controllers: set[str]

    @abc.abstractmethod
    def setup(self) -> None:
        """Make the daemon's part of the tree; kill and remove what a daemon
        that died left there."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up log and `stats`."""

    @abc.abstractmethod
    def attach(self, session_id: str, pid: int, max_memory_mb: int, max_processes: int | None,
               uid: int | None = None, share: Shares | None = None) -> None:
        """Put a worker that has not run session code yet in its session's
        cgroup (under its owner's `u-UID`, limited to the owner's `share`),
        with the session's limits."""

    @abc.abstractmethod
    def limit(self, session_id: str, max_memory_mb: int, max_processes: int | None,
              share: Shares | None = None) -> None:
        """New limits for a live session and its owner's share (a reload)."""

    @abc.abstractmethod
    def user_room(self, uid: int | None) -> str:
        """'' when the owner's `u-UID` can take one more worker; else why not."""

    @abc.abstractmethod
    def kill(self, session_id: str) -> None:
        """SIGKILL every process of the session."""

    @abc.abstractmethod
    def pids(self, session_id: str) -> list[int]:
        """The processes in the session's cgroup."""

    @abc.abstractmethod
    def memory_bytes(self, session_id: str) -> int | None:
        """The kernel's count of the session's memory (page cache, tmpfs and
        memfd pages included), or None without a memory controller."""

    @abc.abstractmethod
    def oom_mark(self, session_id: str) -> OomMark:
        """The session's OOM counters now (at its worker's attach)."""

    @abc.abstractmethod
    def oom_cause(self, session_id: str, mark: OomMark) -> OomCause | None:
        """Whether the session met a memory ceiling with nothing left to
        reclaim since `mark`, and which: its own cap, its owner's share or
        the daemon's ceiling (None: none, or no memory controller)."""

    @abc.abstractmethod
    def user_memory_bytes(self, uid: int | None) -> int | None:
        """What the owner's `u-UID` holds (the kernel's count), or None."""

    def oom_fd(self, session_id: str) -> int | None:
        """An fd that becomes readable when the kernel OOM-kills in the
        session (v1's eventfd on memory.oom_control), or None: then the
        exit of the worker (or the sweep) is where it is seen."""
        return None

    @abc.abstractmethod
    def release(self, session_id: str) -> None:
        """Kill what is left of the session and remove its cgroup (a cgroup
        with processes cannot go: the next release or start retries)."""


class OomWatch:
    """Each session's OOM notification (`Cgroups.oom_fd`: an eventfd on v1's
    memory.oom_control), watched on the daemon's loop: `told` is called
    when the kernel signals it, the eventfd's count read first."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}  # session id -> the fd watched

    def watch(self, session_id: str, fd: int, told: Callable[[], None]) -> None:
        if self._fds.get(session_id) == fd:
            return

        def ready() -> None:
            with contextlib.suppress(OSError):
                os.read(fd, 8)
            told()

        asyncio.get_running_loop().add_reader(fd, ready)
        self._fds[session_id] = fd

    def unwatch(self, session_id: str) -> None:
        fd = self._fds.pop(session_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)


def own_cgroups() -> dict[str, str]:
    """Our path in each hierarchy, from /proc/self/cgroup: controller (or
    "" for the unified v2 hierarchy) -> path."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for ctrl in ctrls.split(",") if ctrls else [""]:
                out[ctrl] = path
    return out


def cgroup_mounts() -> dict[str, tuple[Path, str]]:
    """Where each hierarchy is mounted: controller (or "" for cgroup2) ->
    (mount point, the cgroup at its root).  The first mount of each."""
    out: dict[str, tuple[Path, str]] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                fstype, options = fields[sep + 1], fields[sep + 3].split(",")
                point = Path(fields[4].replace("\\040", " "))
                if fstype == "cgroup2":
                    out.setdefault("", (point, fields[3]))
                elif fstype == "cgroup":
                    for ctrl in options:
                        if ctrl in ("memory", "pids", "cpu", "freezer"):
                            out.setdefault(ctrl, (point, fields[3]))
    except (OSError, ValueError, IndexError):
        return out
    return out
