"""The /proc files of the daemon's sessions' processes, kept open by pid.

Runs in the daemon's loop (the memory sweep, `SessionMemory.measure`, and
`status`); the Ray node host keeps one of its own.  `/proc/PID/statm` for the
resident pages, `/proc/PID/task/PID/children` for the next generation and
`/proc/PID/stat` for the CPU ticks, each opened once and re-read with
`pread` (about a microsecond each, against 7-10 for psutil's
`memory_info()`).

Kept-open /proc files are safe against pid reuse: they stay bound to the
process they were opened for and fail with ESRCH once it is gone.  Kills
must be too: a descendant gets a pidfd when first seen (`pidfd`), checked
against its statm fd.

A worker on another machine (cluster mode) has a pid of REMOTE_PIDS or
above, a handle of its spawner's that names no process here: the table
reads nothing of this machine for it, and gives what its node measured of
the worker's whole tree (`remote`), with no children of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Protocol

from supervisor.spawn.pidfd import PidFd

__all__ = ["CLOCK_TICKS", "PAGE_SIZE", "REMOTE_PIDS", "ProcTable", "RemoteFigures"]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Above the largest pid_max Linux allows (2**22): never a pid of this machine.
REMOTE_PIDS = 1 << 30


class RemoteFigures(Protocol):
    """Where remote workers' figures come from (cluster mode: the RaySpawner,
    as their node hosts report them)."""

    def reported_rss(self, pid: int) -> int | None: ...

    def reported_procs(self, pid: int) -> int | None: ...


def _unknown(pid: int) -> int | None:
    return None


class ProcTable:
    """Open /proc files by pid.  Runs in the daemon."""

    __slots__ = ("_children", "_stat", "_statm", "remote", "remote_procs")

    def __init__(self, remote: RemoteFigures | None = None) -> None:
        self._statm: dict[int, int] = {}
        self._children: dict[int, int] = {}
        self._stat: dict[int, int] = {}
        # A remote worker's tree's memory as its node last reported it.
        self.remote: Callable[[int], int | None] = remote.reported_rss if remote else _unknown
        # ... and the number of processes in that tree, the worker included.
        self.remote_procs: Callable[[int], int | None] = remote.reported_procs if remote else _unknown

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

    def cpu_ticks(self, pid: int) -> int | None:
        """Clock ticks the process ran (user + system) plus those of its
        reaped children; None once it is gone, or for a remote worker."""
        if pid >= REMOTE_PIDS:
            return None
        data = self._read(self._stat, pid, f"/proc/{pid}/stat")
        if not data:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after its last ")".
        fields = data[data.rfind(b")") + 2:].split()
        try:
            return int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
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
        for table in (self._statm, self._children, self._stat):
            fd = table.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def keep_only(self, pids: set[int]) -> None:
        for pid in [p for p in self._statm if p not in pids]:
            self.forget(pid)
        for pid in [p for p in self._children if p not in pids]:
            self.forget(pid)
        for pid in [p for p in self._stat if p not in pids]:
            self.forget(pid)

    def close(self) -> None:
        self.keep_only(set())
