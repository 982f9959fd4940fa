"""A cgroup v2 per session, where the daemon owns a delegated subtree.

Under systemd with `Delegate=yes` (or any cgroup v2 directory the daemon may
write): `cgroup.kill` ends every process of the session at once;
`memory.max` with `memory.oom.group` (the kernel kills the whole session
when the cap is hit); `pids.max`; `cpu.weight` below the daemon's.  Each
only when the controller is delegated.  Each owner's level (`u-UID`) holds
its share: `pids.max` = `max_processes_per_uid`, `memory.max` =
`max_memory_mb_per_uid` (at it the kernel kills in that user's sessions
only, each whole: `memory.oom.group` of the session's cgroup).

Layout (cgroup v2's "no internal processes" rule wants the daemon in a leaf):

    <the daemon's cgroup>/daemon/                 the daemon and the zygote
    <the daemon's cgroup>/sessions/               all sessions: cpu.weight
    <the daemon's cgroup>/sessions/u-UID/s-ID/    one session's worker and tools

Runs in the daemon only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from supervisor.spawn.cgroups import (
    Cgroups, OomCause, OomMark, Shares, cgroup_mounts, flat_key, nice_weight, own_cgroups, remove_empty, room_left,
    within_share,
)

__all__ = ["CgroupsV2", "detect"]

log = logging.getLogger("sessiond")


def detect(nice: int) -> tuple[CgroupsV2 | None, str]:
    """(CgroupsV2, '') where our v2 cgroup is delegated to us, else (None, why)."""
    mount = cgroup_mounts().get("")
    path = own_cgroups().get("")
    if mount is None or path is None:
        return None, "no cgroup v2 hierarchy is mounted"
    here = mount[0] / path.lstrip("/")
    not_ours = f"the daemon's cgroup v2 {path} is not delegated to it (under systemd: Delegate=yes)"
    if path == "/":
        return None, "the daemon is in the root cgroup v2, not one delegated to it"
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
        return None, f"the daemon shares its cgroup v2 {path} with other processes"
    return CgroupsV2(here, nice), ""


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _delegated_by_systemd(path: Path) -> bool:
    """systemd marks a cgroup it delegated (Delegate=yes) with an xattr."""
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name) == b"1":
                return True
    return False


class CgroupsV2(Cgroups):
    """The daemon's delegated subtree."""

    version = 2

    def __init__(self, root: Path, nice: int = 0) -> None:
        self.root = root
        self.sessions = root / "sessions"
        self.controllers: set[str] = set()
        self._nice = nice
        self._uid: dict[str, int | None] = {}

    def setup(self) -> None:
        """Move the daemon into its leaf and enable what we can below."""
        leaf = self.root / "daemon"
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))  # alone in it: detect checked
        available = set((self.root / "cgroup.controllers").read_text().split())
        wanted = ("memory", "pids", "cpu") if self._nice else ("memory", "pids")
        self.controllers = {c for c in wanted if c in available}
        self.sessions.mkdir(exist_ok=True)
        for stale in [*self.sessions.glob("s-*"), *self.sessions.glob("u-*/s-*")]:  # a dead daemon's
            self._release_dir(stale)
        for parent in (self.root, self.sessions):
            self._enable(parent)
        if "cpu" in self.controllers:
            # The daemon's leaf keeps the default weight (100).
            with contextlib.suppress(OSError):
                (self.sessions / "cpu.weight").write_text(str(max(1, nice_weight(self._nice) * 100 // 1024)))

    def _enable(self, parent: Path) -> None:
        for controller in sorted(self.controllers):
            try:
                (parent / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError as exc:
                log.warning("cgroup %s: cannot enable %s: %s", parent, controller, exc.strerror)
                self.controllers.discard(controller)

    def describe(self) -> str:
        shown = ", ".join(sorted(self.controllers)) or "no memory or pids controller delegated"
        return f"a cgroup v2 per session under {self.root} ({shown})"

    def _dir(self, session_id: str) -> Path:
        if session_id in self._uid:
            uid = self._uid[session_id]
            return self.sessions / (f"u-{uid}" if uid is not None else "u-any") / f"s-{session_id}"
        found = list(self.sessions.glob(f"u-*/s-{session_id}"))
        return found[0] if found else self.sessions / "u-any" / f"s-{session_id}"

    def _user_dir(self, uid: int | None) -> Path:
        return self.sessions / (f"u-{uid}" if uid is not None else "u-any")

    def attach(self, session_id: str, pid: int, max_memory_mb: int, max_processes: int | None,
               uid: int | None = None, share: Shares | None = None) -> None:
        self._uid[session_id] = uid
        cg = self._dir(session_id)
        if not cg.parent.exists():
            cg.parent.mkdir(exist_ok=True)
            self._enable(cg.parent)
        if share is not None:
            self._write(cg.parent, share.memory_mb, share.processes)
        cg.mkdir(exist_ok=True)
        self._write(cg, max_memory_mb, within_share(max_processes, share))
        if "memory" in self.controllers:
            (cg / "memory.oom.group").write_text("1")
        (cg / "cgroup.procs").write_text(str(pid))

    def _write(self, cg: Path, max_memory_mb: int, max_processes: int | None) -> None:
        if "memory" in self.controllers:
            (cg / "memory.max").write_text(str(max_memory_mb << 20))
        if "pids" in self.controllers:
            (cg / "pids.max").write_text(str(max_processes) if max_processes else "max")

    def limit(self, session_id: str, max_memory_mb: int, max_processes: int | None,
              share: Shares | None = None) -> None:
        cg = self._dir(session_id)
        with contextlib.suppress(OSError):
            if share is not None:
                self._write(cg.parent, share.memory_mb, share.processes)
            self._write(cg, max_memory_mb, within_share(max_processes, share))

    def user_room(self, uid: int | None) -> str:
        if "pids" not in self.controllers:
            return ""
        user = self._user_dir(uid)
        return room_left(_read_int(user / "pids.current"), _read_int(user / "pids.max"), uid)

    def kill(self, session_id: str) -> None:
        """cgroup.kill (Linux 5.14+): asynchronous, see `pids`."""
        with contextlib.suppress(OSError):
            (self._dir(session_id) / "cgroup.kill").write_text("1")

    def pids(self, session_id: str) -> list[int]:
        try:
            return [int(p) for p in (self._dir(session_id) / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def memory_bytes(self, session_id: str) -> int | None:
        if "memory" not in self.controllers:
            return None
        try:
            return int((self._dir(session_id) / "memory.current").read_text())
        except (OSError, ValueError):
            return None

    def oom_mark(self, session_id: str) -> OomMark:
        if "memory" not in self.controllers:
            return OomMark()
        cg = self._dir(session_id)
        events, user = cg / "memory.events", cg.parent / "memory.events"
        return OomMark(flat_key(events, "oom"), flat_key(user, "oom"), flat_key(events, "oom_kill"))

    def oom_cause(self, session_id: str, mark: OomMark) -> OomCause | None:
        """v2 counts an `oom` at the cgroup whose limit was met (and its
        ancestors), an `oom_kill` at the victim's (and its ancestors)."""
        if "memory" not in self.controllers:
            return None
        now = self.oom_mark(session_id)
        if now.own > mark.own:
            return "own"
        if now.kills <= mark.kills:
            return None
        return "user" if now.user > mark.user else "unit"

    def user_memory_bytes(self, uid: int | None) -> int | None:
        if "memory" not in self.controllers:
            return None
        return _read_int(self._user_dir(uid) / "memory.current")

    def release(self, session_id: str) -> None:
        self._release_dir(self._dir(session_id))
        self._uid.pop(session_id, None)

    def _release_dir(self, cg: Path) -> None:
        with contextlib.suppress(OSError):
            (cg / "cgroup.kill").write_text("1")
        remove_empty(cg, lambda d: d == self.sessions)
