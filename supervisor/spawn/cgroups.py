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
  sessions share one user's share.

`supervisor.spawn.cgroups_detect` (`[daemon] cgroups = "auto"`) takes, in order:

1. a delegated cgroup v2 subtree (systemd `Delegate=yes`): `cgroups_v2`;
2. as root, writable cgroup v1 `memory` and `pids` hierarchies (with `cpu`
   and `freezer` when mounted): `cgroups_v1`;
3. none: the tool host and the zygote contain processes, RLIMIT_NPROC and
   the memory sweep enforce the limits (what `detect` returns says why).
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("sessiond")

__all__ = ["Cgroups", "cgroup_mounts", "flat_key", "nice_weight", "own_cgroups", "remove_empty"]

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
               uid: int | None = None) -> None:
        """Put a worker that has not run session code yet in its session's
        cgroup (under its owner's `u-UID`), with the session's limits."""

    @abc.abstractmethod
    def limit(self, session_id: str, max_memory_mb: int, max_processes: int | None) -> None:
        """New limits for a live session (a reload)."""

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
    def ooms(self, session_id: str) -> int:
        """How often the session met its memory cap with nothing left to
        reclaim (v2: the kernel's OOM kills; v1: those and a session held
        at its cap now), 0 without a memory controller."""

    def oom_fd(self, session_id: str) -> int | None:
        """An fd that becomes readable when the kernel OOM-kills in the
        session (v1's eventfd on memory.oom_control), or None: then the
        exit of the worker (or the sweep) is where it is seen."""
        return None

    @abc.abstractmethod
    def release(self, session_id: str) -> None:
        """Kill what is left of the session and remove its cgroup (a cgroup
        with processes cannot go: the next release or start retries)."""


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
