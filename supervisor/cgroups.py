"""A cgroup v2 per session, where the daemon owns a delegated subtree.

Under systemd with `Delegate=yes` (or any cgroup v2 directory the daemon may
write), each session's worker is put in a cgroup of its own before it runs
any handler code, and everything it and its tools start stays there:

- `cgroup.kill` ends every process of the session at once, whatever it did
  to leave the worker's tree (setsid, double fork);
- `memory.max` (the session's `max_memory_mb`) with `memory.oom.group`: the
  kernel enforces the cap at allocation time, not one poll later, and kills
  the whole session when it is hit; `pids.max` (`max_processes`): a fork
  bomb stops at the limit.  Each only when the controller is delegated.

Layout (cgroup v2's "no internal processes" rule wants the daemon in a leaf):

    <the daemon's cgroup>/daemon/          the daemon and the zygote
    <the daemon's cgroup>/sessions/s-ID/   one session's worker and tools

Where there is no delegated cgroup v2 (cgroup v1 hosts such as the one the
tests run on, a unit without `Delegate=yes`), nothing here is used and the
fallbacks hold: the tool host and the zygote for containment, RLIMIT_NPROC
and the memory sweep for the limits.  `detect` says which, once, at start.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

__all__ = ["Cgroups", "detect"]

log = logging.getLogger("sessiond")

_WANTED = ("memory", "pids")


def _own_cgroup() -> str | None:
    """Our path in the unified (v2) hierarchy, from /proc/self/cgroup."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        return None
    return None


def _cgroup2_mount() -> Path | None:
    """Where the cgroup2 filesystem is mounted (the first such mount)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                if fields[sep + 1] == "cgroup2" and fields[3] == "/":
                    return Path(fields[4].replace("\\040", " "))
    except (OSError, ValueError, IndexError):
        return None
    return None


def detect(setting: str) -> tuple[Cgroups | None, str]:
    """(Cgroups, '') where the daemon may manage cgroups, else (None, why)."""
    if setting == "off":
        return None, "[daemon] cgroups = off"
    mount = _cgroup2_mount()
    path = _own_cgroup()
    if mount is None or path is None:
        return None, "no cgroup v2 hierarchy is mounted (a cgroup v1 host)"
    here = mount / path.lstrip("/")
    not_ours = f"the daemon's cgroup {path} is not delegated to it (under systemd: Delegate=yes)"
    if path == "/":
        return None, "the daemon is in the root cgroup, not one delegated to it"
    if not os.access(here / "cgroup.procs", os.W_OK) or not os.access(here / "cgroup.subtree_control", os.W_OK):
        return None, not_ours
    if os.environ.get("INVOCATION_ID") and not _delegated_by_systemd(here):
        return None, not_ours
    try:
        others = set((here / "cgroup.procs").read_text().split()) - {str(os.getpid())}
    except OSError as exc:
        return None, f"cannot read {here}: {exc.strerror}"
    if others:
        # Someone else's cgroup (a shell's, a container's): moving its
        # processes around is not ours to do.
        return None, f"the daemon shares its cgroup {path} with other processes"
    return Cgroups(here), ""


def _delegated_by_systemd(path: Path) -> bool:
    """systemd marks a cgroup it delegated (Delegate=yes) with an xattr."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name) == b"1":
                return True
    return False


class Cgroups:
    """The daemon's delegated subtree.  Runs in the daemon only."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sessions = root / "sessions"
        self.controllers: set[str] = set()

    def setup(self) -> None:
        """Move the daemon into its leaf and enable what we can below."""
        leaf = self.root / "daemon"
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))  # alone in it: detect checked
        available = set((self.root / "cgroup.controllers").read_text().split())
        self.controllers = {c for c in _WANTED if c in available}
        self.sessions.mkdir(exist_ok=True)
        for stale in self.sessions.glob("s-*"):  # left by a daemon that died
            self.release(stale.name[2:])
        for parent in (self.root, self.sessions):
            for controller in self.controllers:
                try:
                    (parent / "cgroup.subtree_control").write_text(f"+{controller}")
                except OSError as exc:
                    log.warning("cgroup %s: cannot enable %s: %s", parent, controller, exc.strerror)
                    self.controllers.discard(controller)

    def describe(self) -> str:
        shown = ", ".join(sorted(self.controllers)) or "no memory or pids controller delegated"
        return f"a cgroup v2 per session under {self.root} ({shown})"

    def _dir(self, session_id: str) -> Path:
        return self.sessions / f"s-{session_id}"

    def attach(self, session_id: str, pid: int, max_memory_mb: int, max_processes: int | None) -> None:
        """Put a worker that has not run session code yet in its session's cgroup."""
        cg = self._dir(session_id)
        cg.mkdir(exist_ok=True)
        if "memory" in self.controllers:
            (cg / "memory.max").write_text(str(max_memory_mb << 20))
            (cg / "memory.oom.group").write_text("1")
        if "pids" in self.controllers:
            (cg / "pids.max").write_text(str(max_processes) if max_processes else "max")
        (cg / "cgroup.procs").write_text(str(pid))

    def limit(self, session_id: str, max_memory_mb: int, max_processes: int | None) -> None:
        """New limits for a live session (a reload)."""
        cg = self._dir(session_id)
        with contextlib.suppress(OSError):
            if "memory" in self.controllers:
                (cg / "memory.max").write_text(str(max_memory_mb << 20))
            if "pids" in self.controllers:
                (cg / "pids.max").write_text(str(max_processes) if max_processes else "max")

    def kill(self, session_id: str) -> None:
        """SIGKILL every process of the session (Linux 5.14+)."""
        with contextlib.suppress(OSError):
            (self._dir(session_id) / "cgroup.kill").write_text("1")

    def pids(self, session_id: str) -> list[int]:
        try:
            return [int(p) for p in (self._dir(session_id) / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def release(self, session_id: str) -> None:
        """Kill what is left of the session and remove its cgroup (a cgroup
        with processes cannot go: EBUSY; the next release or start retries)."""
        self.kill(session_id)
        try:
            self._dir(session_id).rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                log.warning("cannot remove cgroup of session %s: %s", session_id, exc.strerror)
