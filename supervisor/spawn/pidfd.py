"""Process handles that survive pid reuse, for every kill the daemon makes.

A pid number is only a name: once its process is reaped the number can be
given to an unrelated process, so `kill(pid)` some time after learning the
pid can hit a stranger.  A pidfd names the process itself; a signal sent
through it reaches that process or fails with ESRCH.

Process groups the same way: `killpg(N)` names whatever group has the
number N now.  `pidfd_send_signal(fd, sig, PIDFD_SIGNAL_PROCESS_GROUP)`
(Linux 6.9) names the group whose id is the pidfd's *struct pid*: the kernel
keeps that object alive for the fd even after the leader is reaped, and a
process that later gets the same number gets a different struct pid.  So a
worker's pidfd (a worker leads its own group) reaches the tools left in its
group for as long as we hold it, and never anyone else's.  Without that
flag (older kernels: EINVAL) we fall back to `killpg`, only while the
worker's pidfd shows it not yet reaped: its zombie holds the number.  That
leaves a window of two syscalls in which the zygote might reap it and the
number be reused as a group id; the 6.9 path has none.

Runs in the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal

__all__ = ["PidFd", "kill_uid"]

_PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2
_group_flag_works: bool | None = None


class PidFd:
    """An owned pidfd (closed by `close()`, or when the object goes away,
    so an fd number is never used after it was given back)."""

    __slots__ = ("fd", "pid")

    def __init__(self, fd: int, pid: int) -> None:
        self.fd = fd
        self.pid = pid

    def send(self, sig: int) -> bool:
        """Signal the process; False once it is gone (or the fd closed)."""
        if self.fd < 0:
            return False
        try:
            signal.pidfd_send_signal(self.fd, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def send_group(self, sig: int) -> bool:
        """Signal the process group this process leads (see the module
        docstring for why this is safe after the leader is reaped); False
        once nothing of the group is left."""
        global _group_flag_works
        if self.fd < 0:
            return False
        if _group_flag_works is not False:
            try:
                signal.pidfd_send_signal(self.fd, sig, None, _PIDFD_SIGNAL_PROCESS_GROUP)
                _group_flag_works = True
                return True
            except (ProcessLookupError, PermissionError):
                return False
            except OSError as exc:
                if exc.errno != errno.EINVAL or _group_flag_works:
                    raise
                _group_flag_works = False
        if not self.send(0):
            return False  # reaped: the number is no longer ours to name
        try:
            os.killpg(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as exited)."""
        if self.fd < 0:
            return True
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        return bool(p.poll(0))

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PidFd(pid={self.pid}, fd={self.fd})"


def kill_uid(uid: int, rounds: int = 20) -> None:
    """SIGKILL every process whose real uid is `uid` (a session's own uid:
    nothing else runs as it), through pidfds, checked after opening; again
    while any are found, for those forked meanwhile (bounded: it runs on
    the daemon's loop, and a cgroup is the complete kill)."""
    for _ in range(rounds):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or _real_uid(name) != uid:
                continue
            try:
                fd = os.pidfd_open(int(name))
            except OSError:
                continue
            try:
                if _real_uid(name) == uid:  # the pidfd names this very process
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    found = True
            except OSError:
                pass
            finally:
                os.close(fd)
        if not found:
            return


def _real_uid(pid: str) -> int | None:
    """A live process's real uid (None for a zombie: it is dead already)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"State:") and line.split()[1] == b"Z":
                    return None
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None
