"""Measuring sessions' memory, and the pure decisions about limits.

A session's memory is the RSS of its worker plus every descendant (a tool
that allocates 2 GiB is the session's).  One sweep reads each process once:
`/proc/PID/statm` for the resident pages and `/proc/PID/task/PID/children`
for the next generation, both kept open between sweeps and re-read with
`pread` (about a microsecond each, against 7-10 for psutil's
`memory_info()`), so the cost per sweep is proportional to processes, not to
sessions x processes.

A descendant stays counted after it re-parents (a tool that double-forks
lands on the zygote, our subreaper): once seen as a session's, a pid is
tracked until it exits, and it is killed with the session.

A worker on another machine (cluster mode) has a pid of REMOTE_PIDS or
above, a handle of its spawner's that names no process here: the table
reads nothing of this machine for it, and gives what its node measured of
the worker's whole tree (`remote`), with no children of its own.

Kept-open /proc files are safe against pid reuse: they stay bound to the
process they were opened for and fail with ESRCH once it is gone.  Kills
must be too: a descendant gets a pidfd when first seen (`ProcTable.pidfd`),
checked against its statm fd, and the session is killed through those.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from supervisor.pidfd import PidFd

__all__ = [
    "HEARTBEATS_MISSED",
    "REMOTE_PIDS",
    "MemoryVerdict",
    "ProcTable",
    "SessionMemory",
    "heartbeat_overdue",
    "idle_expired",
    "memory_verdict",
    "turn_deadline_left",
]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024
# Above the largest pid_max Linux allows (2**22): never a pid of this machine.
REMOTE_PIDS = 1 << 30


class ProcTable:
    """Open /proc files by pid.  Runs in the daemon."""

    __slots__ = ("_children", "_statm", "remote", "remote_procs")

    def __init__(self) -> None:
        self._statm: dict[int, int] = {}
        self._children: dict[int, int] = {}
        # A remote worker's tree's memory as its node last reported it.
        self.remote: Callable[[int], int | None] = lambda pid: None
        # ... and the number of processes in that tree, the worker included.
        self.remote_procs: Callable[[int], int | None] = lambda pid: None

    def _read(self, table: dict[int, int], pid: int, path: str) -> bytes | None:
        """The file's content; None once the process is gone (ESRCH)."""
        fd = table.get(pid)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            table[pid] = fd
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            self.forget(pid)
            return None

    def rss(self, pid: int) -> int | None:
        if pid >= REMOTE_PIDS:
            return self.remote(pid)
        data = self._read(self._statm, pid, f"/proc/{pid}/statm")
        if not data:  # gone, or a zombie's empty statm
            return None
        try:
            return int(data.split(None, 2)[1]) * PAGE_SIZE
        except (IndexError, ValueError):
            return None

    def pss(self, pid: int) -> int | None:
        """Proportional set size (smaps_rollup): shared pages divided among
        their sharers.  None when the kernel will not tell us (a non-root
        daemon and a non-dumpable worker) or the process is gone.  A remote
        worker: its node's RSS figure (no finer one is reported)."""
        if pid >= REMOTE_PIDS:
            return self.remote(pid)
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                data = f.read()
        except OSError:
            return None
        at = data.find(b"\nPss:")
        if at < 0:
            return None
        try:
            return int(data[at + 5:].split(None, 1)[0]) * 1024
        except (IndexError, ValueError):
            return None

    def children(self, pid: int) -> list[int]:
        # Empty is the common case (no children), not a sign of exit: the
        # file stays open for the next sweep.
        if pid >= REMOTE_PIDS:
            return []
        data = self._read(self._children, pid, f"/proc/{pid}/task/{pid}/children")
        return [int(x) for x in data.split()] if data else []

    def pidfd(self, pid: int) -> PidFd | None:
        """A pidfd for the process whose statm this table holds open, or
        None.  pidfd_open(pid) names whichever process has the number now;
        the statm fd, opened earlier, still reads afterwards only if the
        process it was opened for was not reaped meanwhile, and then that
        process held the number all along: the pidfd is its."""
        statm = self._statm.get(pid)
        if statm is None or pid >= REMOTE_PIDS:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        try:
            os.pread(statm, 1, 0)
        except OSError:
            os.close(fd)
            self.forget(pid)
            return None
        return PidFd(fd, pid)

    def forget(self, pid: int) -> None:
        for table in (self._statm, self._children):
            fd = table.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def keep_only(self, pids: set[int]) -> None:
        for pid in [p for p in self._statm if p not in pids]:
            self.forget(pid)
        for pid in [p for p in self._children if p not in pids]:
            self.forget(pid)

    def close(self) -> None:
        self.keep_only(set())


@dataclass(slots=True)
class SessionMemory:
    """What the last sweep saw of one session's processes."""

    rss_bytes: int = 0
    pids: set[int] = field(default_factory=set)  # worker excluded
    high: bool = False  # above memory_high_mb at the last sweep
    # Owned handles of the tracked descendants, to kill them by (not by pid).
    pidfds: dict[int, PidFd] = field(default_factory=dict)

    def escapees(self) -> list[PidFd]:
        """Handles of every tracked descendant: the ones that left the
        worker's process group are reached only through these."""
        return list(self.pidfds.values())

    def close(self) -> None:
        for fd in self.pidfds.values():
            fd.close()
        self.pidfds.clear()

    def measure(self, table: ProcTable, worker_pid: int) -> int:
        """Sum the RSS of the worker, its descendants and known escapees."""
        if not self.pids:
            # The common case, an idle worker with no tools: two preads.
            rss = table.rss(worker_pid)
            kids = table.children(worker_pid) if rss is not None else []
            if not kids:
                self.rss_bytes = rss or 0
                return self.rss_bytes
        total = 0
        seen: set[int] = set()
        stack = [worker_pid, *self.pids]
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            rss = table.rss(pid)
            if rss is None:
                continue
            seen.add(pid)
            total += rss
            stack.extend(table.children(pid))
        seen.discard(worker_pid)
        self.pids = seen
        for pid in [p for p in self.pidfds if p not in seen]:
            self.pidfds.pop(pid).close()  # gone (or a zombie): nothing to kill
        for pid in seen:
            if pid not in self.pidfds:
                handle = table.pidfd(pid)
                if handle is not None:
                    self.pidfds[pid] = handle
        self.rss_bytes = total
        return total

    def measure_pss(self, table: ProcTable, worker_pid: int) -> int:
        """What the session's processes really cost, for a figure near a cap.

        Summing RSS counts every page shared between processes once per
        process: 85 forks of a 28 MiB worker "used" 2 GiB.  PSS splits each
        shared page among its sharers.  Reading smaps_rollup walks the page
        tables, so the sweep asks only when the cheap RSS sum (never below
        the PSS sum) is over a limit.  A process whose PSS we may not read
        counts its RSS."""
        total = 0
        for pid in (worker_pid, *self.pids):
            pss = table.pss(pid)
            total += pss if pss is not None else table.rss(pid) or 0
        self.rss_bytes = total
        return total


@dataclass(slots=True, frozen=True)
class MemoryVerdict:
    kill: bool = False
    high_crossed: bool = False  # newly above memory_high_mb: tell once
    high_cleared: bool = False


_OK = MemoryVerdict()
_KILL = MemoryVerdict(kill=True)
_CROSSED = MemoryVerdict(high_crossed=True)
_CLEARED = MemoryVerdict(high_cleared=True)


def memory_verdict(rss_bytes: int, max_mb: int, high_mb: int | None, was_high: bool) -> MemoryVerdict:
    """What one sweep's figure means for one session (runs per session per
    sweep: shared constant verdicts, no allocation)."""
    if rss_bytes > max_mb * MIB:
        return _KILL
    above = high_mb is not None and rss_bytes > high_mb * MIB
    if above and not was_high:
        return _CROSSED
    if was_high and not above:
        return _CLEARED
    return _OK


# Missed heartbeats before a worker's loop counts as stuck.
HEARTBEATS_MISSED = 3


def heartbeat_overdue(now: float, last_heartbeat: float, interval_secs: float, booted: bool) -> bool:
    """A booted worker silent for more than HEARTBEATS_MISSED intervals: its
    event loop is stuck (a busy loop, a blocking call)."""
    return booted and now - last_heartbeat > HEARTBEATS_MISSED * interval_secs


def idle_expired(now: float, last_active: float, idle_secs: float, idle: bool, busy: bool) -> bool:
    """An idle session untouched for longer than session_timeout_secs, and
    not busy with anything else: time to hibernate it."""
    return idle and not busy and now - last_active > idle_secs


def turn_deadline_left(now: float, turn_started: float, timeout_secs: float) -> float:
    """Seconds left of a turn's timeout, counted from its start (0 when past)."""
    return max(timeout_secs - (now - turn_started), 0.0)
