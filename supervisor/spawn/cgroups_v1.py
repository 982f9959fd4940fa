"""A cgroup per session in each cgroup v1 hierarchy, for a root daemon.

On a host whose controllers are bound to cgroup v1 (the `memory`, `pids`,
`cpu` and `freezer` hierarchies mounted apart, no v2 subtree delegated), a
root daemon makes in each hierarchy, below its own cgroup there:

    <mount>/<own path>/sessiond/d-PID-START/              this daemon: cpu.shares
    <mount>/<own path>/sessiond/d-PID-START/u-UID/s-ID/   one session

`d-PID-START` (the daemon's pid and start time) keeps daemons that share a
cgroup apart (no unit of their own, as in tests); a daemon finds the
directories of daemons that are no longer running at start and kills and
removes them.

- memory: `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes`,
  where swap is accounted) = `max_memory_mb`: the kernel counts page cache,
  tmpfs and memfd pages the session wrote.  v1 has no `memory.oom.group`
  (the kernel's OOM killer would kill one process, and the rest of the
  session would see it die first): the OOM killer is off for the session
  (`oom_kill_disable`), so a process at the cap waits, and the daemon,
  woken by an eventfd on `memory.oom_control` (`oom_fd`), kills the whole
  session.  (Were the daemon gone, the zygote kills every worker.)
- pids: `pids.max` = `max_processes`.
- per owner (`u-UID`): `pids.max` = `max_processes_per_uid`, the memory
  limit = `max_memory_mb_per_uid`, its OOM killer off as well: when a
  user's sessions together reach their share, the daemon (woken by the
  eventfd of any of them: v1 notifies a cgroup's whole subtree) kills that
  user's largest session whole, and no other user's.
- cpu (optional): `cpu.shares` of the daemon's directory, all its sessions
  together, at the weight of one task at `session_nice`.
- freezer (optional): the kill freezes the session first, so that nothing
  forks or exits between the listing of its processes and their SIGKILL.
  v1 has no `cgroup.kill`: without freezer, kills repeat until it is empty.

Runs in the daemon only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from pathlib import Path

from supervisor.spawn.cgroups import (
    Cgroups, OomCause, OomMark, Shares, cgroup_mounts, flat_key, nice_weight, own_cgroups, remove_empty, room_left,
    within_share,
)

__all__ = ["CgroupsV1", "detect"]

log = logging.getLogger("sessiond")

_REQUIRED = ("memory", "pids")
_OPTIONAL = ("cpu", "freezer")
# A kill: rounds of freeze, SIGKILL everything, thaw for at most this long
# (it runs on the daemon's loop; SIGKILLed processes leave cgroup.procs as
# they exit, within a round or two; one stuck in the kernel is left to the
# next release), and this long for a freezer to report FROZEN.
_KILL_SECS = 0.25
_FREEZE_WAIT_SECS = 0.05


def detect(nice: int) -> tuple[CgroupsV1 | None, str]:
    """(CgroupsV1, '') where a root daemon may write the memory and pids
    hierarchies (v1), else (None, why)."""
    mounts = cgroup_mounts()
    own = own_cgroups()
    dirs: dict[str, Path] = {}
    for ctrl in (*_REQUIRED, *_OPTIONAL):
        if ctrl == "cpu" and not nice:
            continue
        if ctrl not in mounts or ctrl not in own:
            if ctrl in _REQUIRED:
                return None, f"no cgroup v1 {ctrl} hierarchy is mounted"
            continue
        point, root = mounts[ctrl]
        path = own[ctrl]
        if not (path == root or path.startswith(root.rstrip("/") + "/")):
            if ctrl in _REQUIRED:
                return None, f"the daemon's cgroup v1 {ctrl} {path} is outside the mounted {root}"
            continue
        here = point / path[len(root):].lstrip("/")
        if not os.access(here, os.W_OK):
            if ctrl in _REQUIRED:
                return None, f"cgroup v1 {ctrl} {here} is not writable"
            continue
        dirs[ctrl] = here
    return CgroupsV1(dirs, nice), ""


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): with its pid, a name
    no later process has."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _read_pids(cg: Path) -> list[int]:
    try:
        return [int(p) for p in (cg / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


class CgroupsV1(Cgroups):
    """The daemon's directories in the v1 hierarchies: controller -> the
    daemon's own cgroup there."""

    version = 1

    def __init__(self, own: dict[str, Path], nice: int = 0) -> None:
        self._own = own
        self._nice = nice
        self.controllers: set[str] = set(own)
        me = f"d-{os.getpid()}-{_start_time(os.getpid())}"
        self.base = {ctrl: d / "sessiond" / me for ctrl, d in own.items()}
        self._uid: dict[str, int | None] = {}
        self._oom: dict[str, tuple[int, int]] = {}  # session -> (eventfd, memory.oom_control fd)

    def setup(self) -> None:
        # The freezer first: a dead daemon's frozen session is thawed before
        # the other hierarchies' kills, or its SIGKILLs would not land.
        for ctrl, base in sorted(self.base.items(), key=lambda kv: kv[0] != "freezer"):
            base.mkdir(parents=True, exist_ok=True)
            for stale in base.parent.glob("d-*"):
                if stale != base and not self._running(stale.name):
                    self._remove_tree(ctrl, stale)
        if "cpu" in self.base:
            (self.base["cpu"] / "cpu.shares").write_text(str(max(2, nice_weight(self._nice))))

    @staticmethod
    def _running(name: str) -> bool:
        """Whether the daemon that made `d-PID-START` still runs."""
        _, pid, start = (name.split("-", 2) + ["", ""])[:3]
        return pid.isdigit() and _start_time(int(pid)) == start

    def _remove_tree(self, ctrl: str, top: Path) -> None:
        """A dead daemon's directory: its sessions killed, then removed
        bottom up (what still holds processes stays until the next start)."""
        # Bottom up, and a directory gone meanwhile is skipped (os.walk's
        # default): another daemon starting at the same moment cleans the
        # same tree (pathlib's rglob raised FileNotFoundError, and this
        # daemon started without cgroups).
        for where, _, _ in os.walk(top, topdown=False):
            cg = Path(where)
            if ctrl == "freezer":  # it may have died in the middle of a kill
                with contextlib.suppress(OSError):
                    (cg / "freezer.state").write_text("THAWED")
            if cg.name.startswith("s-"):
                self.release(cg.name[2:], where={ctrl: cg})
            with contextlib.suppress(OSError):
                cg.rmdir()

    def describe(self) -> str:
        where = ", ".join(f"{c} {self.base[c]}" for c in sorted(self.base))
        return f"a cgroup v1 per session ({', '.join(sorted(self.controllers))}; {where})"

    def _dirs(self, session_id: str) -> dict[str, Path]:
        uid = self._uid.get(session_id, -1)
        out = {}
        for ctrl, base in self.base.items():
            if uid == -1:  # not attached by us in this life: look for it
                found = list(base.glob(f"u-*/s-{session_id}"))
                out[ctrl] = found[0] if found else base / "u-any" / f"s-{session_id}"
            else:
                out[ctrl] = base / (f"u-{uid}" if uid is not None else "u-any") / f"s-{session_id}"
        return out

    def _user_dirs(self, uid: int | None) -> dict[str, Path]:
        return {ctrl: base / (f"u-{uid}" if uid is not None else "u-any") for ctrl, base in self.base.items()}

    def attach(self, session_id: str, pid: int, max_memory_mb: int, max_processes: int | None,
               uid: int | None = None, share: Shares | None = None) -> None:
        self._uid[session_id] = uid
        dirs = self._dirs(session_id)
        for cg in dirs.values():
            cg.mkdir(parents=True, exist_ok=True)
        if share is not None:
            self._share(self._user_dirs(uid), share)
        self._write_limits(dirs, max_memory_mb, within_share(max_processes, share))
        if "memory" in dirs:
            with contextlib.suppress(OSError):
                (dirs["memory"] / "memory.oom_control").write_text("1")  # we kill, whole
            self._watch_oom(session_id, dirs["memory"])
        # Memory first: pages it touches from now on are the session's.
        for ctrl in sorted(dirs, key=lambda c: c != "memory"):
            (dirs[ctrl] / "cgroup.procs").write_text(str(pid))

    def _share(self, user: dict[str, Path], share: Shares) -> None:
        """The owner's level: its share, and its OOM killer off (the daemon
        kills the user's largest session whole, see the module's docstring)."""
        self._write_limits(user, share.memory_mb, share.processes)
        if "memory" in user:
            with contextlib.suppress(OSError):
                (user["memory"] / "memory.oom_control").write_text("1")

    def user_room(self, uid: int | None) -> str:
        pids = self._user_dirs(uid).get("pids")
        if pids is None:
            return ""
        return room_left(_read_int(pids / "pids.current"), _read_int(pids / "pids.max"), uid)

    def _write_limits(self, dirs: dict[str, Path], max_memory_mb: int, max_processes: int | None) -> None:
        if "memory" in dirs:
            mem = dirs["memory"]
            limit = str(max_memory_mb << 20)
            memsw = mem / "memory.memsw.limit_in_bytes"
            # memsw may never be below the memory limit: raise it first, lower it last.
            try:
                memsw.write_text(limit)
                (mem / "memory.limit_in_bytes").write_text(limit)
            except OSError:
                (mem / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):
                    memsw.write_text(limit)
        if "pids" in dirs:
            (dirs["pids"] / "pids.max").write_text(str(max_processes) if max_processes else "max")

    def _watch_oom(self, session_id: str, mem: Path) -> None:
        if session_id in self._oom:
            return
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            ocfd = os.open(mem / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(efd)
            return
        try:
            (mem / "cgroup.event_control").write_text(f"{efd} {ocfd}")
        except OSError as exc:
            log.warning("cgroup %s: no OOM notification: %s", mem, exc.strerror)
            os.close(efd)
            os.close(ocfd)
            return
        self._oom[session_id] = (efd, ocfd)

    def oom_fd(self, session_id: str) -> int | None:
        fds = self._oom.get(session_id)
        return fds[0] if fds is not None else None

    def limit(self, session_id: str, max_memory_mb: int, max_processes: int | None,
              share: Shares | None = None) -> None:
        dirs = self._dirs(session_id)
        with contextlib.suppress(OSError):
            if share is not None:
                self._share({ctrl: d.parent for ctrl, d in dirs.items()}, share)
            self._write_limits(dirs, max_memory_mb, within_share(max_processes, share))

    def kill(self, session_id: str, where: dict[str, Path] | None = None) -> None:
        """Freeze, SIGKILL every process, thaw; again until empty (bounded:
        a process in uninterruptible sleep may take a moment to go)."""
        dirs = where if where is not None else self._dirs(session_id)
        procs = dirs.get("pids") or dirs.get("memory")
        if procs is None:
            return
        freezer = dirs.get("freezer")
        deadline = time.monotonic() + _KILL_SECS
        refused: set[int] = set()  # members our SIGKILL could not be sent to
        while time.monotonic() < deadline:
            pids = _read_pids(procs)
            if not pids:
                return
            frozen = freezer is not None and self._freeze(freezer)
            for pid in _read_pids(procs) if frozen else pids:
                if not self._kill_member(pid, procs, checked=frozen):
                    refused.add(pid)
            if frozen and freezer is not None:
                with contextlib.suppress(OSError):
                    (freezer / "freezer.state").write_text("THAWED")  # the SIGKILLs land
            time.sleep(0.002)
        # Not empty.  Members killed and still exiting (a busy machine, a
        # process freeing hundreds of MiB) go by themselves.  One our kill
        # could not reach (no CAP_KILL, a process we may not signal) would,
        # at the cap, wait in the kernel for ever with the OOM killer off:
        # hand the cgroup back to the kernel's.
        if "memory" in dirs and refused & set(_read_pids(procs)):
            log.warning("cgroup %s: processes outlived the kill; the kernel's OOM killer is on for it",
                        dirs["memory"])
            with contextlib.suppress(OSError):
                (dirs["memory"] / "memory.oom_control").write_text("0")

    @staticmethod
    def _freeze(freezer: Path) -> bool:
        try:
            (freezer / "freezer.state").write_text("FROZEN")
        except OSError:
            return False
        deadline = time.monotonic() + _FREEZE_WAIT_SECS
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if (freezer / "freezer.state").read_text().strip() == "FROZEN":
                    return True
            time.sleep(0.001)
        return True  # FREEZING: the kills still go, and the next round sees the rest

    @staticmethod
    def _kill_member(pid: int, procs: Path, checked: bool) -> bool:
        """SIGKILL through a pidfd.  Frozen, a process cannot exit and free
        its number; not frozen, the pidfd is checked to still be a member
        (its number read from cgroup.procs may have passed on).  False: the
        signal could not be sent to it (EPERM); True: sent, or it is gone."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return True  # (exited meanwhile)
        try:
            if not checked:
                tail = "/" + "/".join(procs.parts[-4:])  # sessiond/d-…/u-…/s-…: ours alone
                with open(f"/proc/{pid}/cgroup") as f:
                    if not any(line.rstrip("\n").endswith(tail) for line in f):
                        return True
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError as exc:
            return exc.errno not in (errno.EPERM, errno.EACCES)  # (else gone meanwhile)
        finally:
            os.close(fd)
        return True

    def pids(self, session_id: str) -> list[int]:
        dirs = self._dirs(session_id)
        procs = dirs.get("pids") or dirs.get("memory")
        return _read_pids(procs) if procs is not None else []

    def memory_bytes(self, session_id: str) -> int | None:
        mem = self._dirs(session_id).get("memory")
        if mem is None:
            return None
        try:
            return int((mem / "memory.usage_in_bytes").read_text())
        except (OSError, ValueError):
            return None

    def oom_mark(self, session_id: str) -> OomMark:
        mem = self._dirs(session_id).get("memory")
        return OomMark(kills=flat_key(mem / "memory.oom_control", "oom_kill")) if mem is not None else OomMark()

    def oom_cause(self, session_id: str, mark: OomMark) -> OomCause | None:
        """v1 marks a whole subtree under OOM: its owner's level under OOM is
        the user's share, whichever session noticed; the session's own
        (alone) its cap.  A kill the kernel made in it (its OOM killer is
        off here) was for a level above: the daemon's own ceiling."""
        mem = self._dirs(session_id).get("memory")
        if mem is None:
            return None
        own = mem / "memory.oom_control"
        if flat_key(mem.parent / "memory.oom_control", "under_oom"):
            return "user"
        if flat_key(own, "under_oom"):
            return "own"
        if flat_key(own, "oom_kill") > mark.kills:
            # The killer put back on for the session (a kill that did not land): its own cap.
            return "own" if not flat_key(own, "oom_kill_disable") else "unit"
        return None

    def user_memory_bytes(self, uid: int | None) -> int | None:
        mem = self._user_dirs(uid).get("memory")
        return _read_int(mem / "memory.usage_in_bytes") if mem is not None else None

    def release(self, session_id: str, where: dict[str, Path] | None = None) -> None:
        dirs = where if where is not None else self._dirs(session_id)
        self.kill(session_id, dirs)
        for efd_ocfd in [self._oom.pop(session_id, None)] if where is None else []:
            if efd_ocfd is not None:
                for fd in efd_ocfd:
                    os.close(fd)
        tops = set(self.base.values())
        for cg in dirs.values():
            remove_empty(cg, lambda d: d in tops or d.name.startswith("d-"))
        if where is None:
            self._uid.pop(session_id, None)
