"""The /proc files of the daemon's sessions' processes, read in batches.

Runs in the daemon's loop (the memory sweep, `SessionMemory.measure` and
`sample_cpu`, and `status`); the Ray node host keeps one of its own.
`/proc/PID/statm` for the resident pages, `/proc/PID/task/PID/children`
for the next generation and `/proc/PID/stat` for the CPU ticks and the
start time.  A file is opened at its first read within a batch, re-read
with `pread` while the batch lasts, and closed when it ends (`release`):
a batch is one session's measure, synchronous on the loop, so the daemon
holds one session's /proc files at most, for microseconds, and a live
session costs it no fd between sweeps however many processes it runs (an
open + pread + close is a few microseconds; bench/proctable.py).

Pid reuse: a /proc file stays bound to the process it was opened for and
fails with ESRCH once that process is reaped, so within a batch every read
of a pid is of one process, and `pidfd` proves the pidfd it opens is that
process (its caller reads the pid first, in the same batch).  Across
batches a number is only a number: a pid tracked from an earlier pass is
read only with a handle that vouches for it (`vouch`: the pidfd taken when
it was first seen, checked after each file is opened), and a worker by
its start time (`stat`, read after its other files).  Kills never go
through this table: they use the pidfds SessionMemory keeps.

A worker on another machine (cluster mode) has a pid of REMOTE_PIDS or
above, a handle of its spawner's that names no process here: the table
reads nothing of this machine for it, and gives what its node measured of
the worker's whole tree (`remote`), with no children of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


_STATM, _CHILDREN, _STAT = 0, 1, 2
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def _path(kind: int, pid: int) -> str:
    if kind == _STATM:
        return f"/proc/{pid}/statm"
    if kind == _CHILDREN:
        return f"/proc/{pid}/task/{pid}/children"
    return f"/proc/{pid}/stat"


def _unreaped(handle: PidFd) -> bool:
    """Whether the handle's process still holds its number (a zombie
    does; a reaped process does not).  EPERM: it exists."""
    if handle.fd < 0:
        return False
    try:
        signal.pidfd_send_signal(handle.fd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcTable:
    """/proc files by pid, open for one batch at a time.  Runs in the daemon."""

    __slots__ = ("_open", "_vouch", "remote", "remote_procs")

    def __init__(self, remote: RemoteFigures | None = None) -> None:
        # This batch's files: pid << 2 | kind -> fd; empty between batches.
        self._open: dict[int, int] = {}
        # This batch's pids read from an earlier pass: the handle that vouches for each.
        self._vouch: dict[int, PidFd] = {}
        # A remote worker's tree's memory as its node last reported it.
        self.remote: Callable[[int], int | None] = remote.reported_rss if remote else _unknown
        # ... and the number of processes in that tree, the worker included.
        self.remote_procs: Callable[[int], int | None] = remote.reported_procs if remote else _unknown

    def vouch(self, pid: int, handle: PidFd) -> None:
        """Read `pid` in this batch only as `handle`'s process: each file
        opened for it is kept only if the handle's process is still
        unreaped after the open (then it held the number all along, so the
        file is its).  Otherwise the pid reads as gone and is no longer
        vouched for (`vouched`): another process may read under that
        number later in the batch, as any pid seen for the first time."""
        self._vouch[pid] = handle

    def vouched(self, pid: int) -> bool:
        return pid in self._vouch

    def _read(self, kind: int, pid: int) -> bytes | None:
        """The file's content; None once the process is gone (ESRCH)."""
        key = pid << 2 | kind
        fd = self._open.get(key)
        if fd is None:
            try:
                fd = os.open(_path(kind, pid), _FLAGS)
            except OSError:
                return None
            self._open[key] = fd
            anchor = self._vouch.get(pid) if self._vouch else None
            if anchor is not None and not _unreaped(anchor):
                del self._vouch[pid]
                self._drop(pid)
                return None
        try:
            return os.pread(fd, 4096, 0)
        except OSError:
            self._drop(pid)
            return None

    def rss(self, pid: int) -> int | None:
        if pid >= REMOTE_PIDS:
            return self.remote(pid)
        data = self._read(_STATM, pid)
        if not data:  # gone, or a zombie's empty statm
            return None
        try:
            return int(data.split(None, 2)[1]) * PAGE_SIZE
        except (IndexError, ValueError):
            return None

    def stat(self, pid: int) -> tuple[int, int, int] | None:
        """From one read of `stat`: the resident bytes (statm's figure),
        the clock ticks the process ran (user + system, plus those of its
        reaped children) and when it started (clock ticks after boot:
        with its pid, the process itself; read after a pid's other files
        in a batch, a match proves them its, as it held the number from
        its start until now).  None once it is gone, or for a remote
        worker."""
        if pid >= REMOTE_PIDS:
            return None
        data = self._read(_STAT, pid)
        if not data:
            return None
        # The command name (field 2) may hold spaces and parentheses: split after its last ")".
        fields = data[data.rfind(b")") + 2:].split(None, 22)
        try:
            ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
            return int(fields[21]) * PAGE_SIZE, ticks, int(fields[19])
        except (IndexError, ValueError):
            return None

    def children(self, pid: int) -> list[int]:
        if pid >= REMOTE_PIDS:
            return []
        data = self._read(_CHILDREN, pid)
        return [int(x) for x in data.split()] if data else []

    def pidfd(self, pid: int) -> PidFd | None:
        """A pidfd for the process this batch read as `pid`, or None.
        Call it after reading the pid (`rss`) and before the batch ends:
        pidfd_open(pid) names whichever process has the number now; the
        statm fd, opened earlier in this batch, still reads afterwards only
        if the process it was opened for was not reaped meanwhile, and then
        that process held the number all along: the pidfd is its."""
        statm = self._open.get(pid << 2 | _STATM)
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
            self._drop(pid)
            return None
        return PidFd(fd, pid)

    def _drop(self, pid: int) -> None:
        for kind in (_STATM, _CHILDREN, _STAT):
            fd = self._open.pop(pid << 2 | kind, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def held(self) -> int:
        """Files open now (0 between batches)."""
        return len(self._open)

    def release(self) -> None:
        """End the batch: close every file it opened, forget its vouchers.
        Every reader calls it before it returns (in a `finally`)."""
        if self._open:
            for fd in self._open.values():
                try:  # (not contextlib.suppress: this runs for every session every sweep)
                    os.close(fd)
                except OSError:
                    pass
            self._open.clear()
        if self._vouch:
            self._vouch.clear()

    def close(self) -> None:
        self.release()
