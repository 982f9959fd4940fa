"""The few Linux process controls Python does not wrap (prctl, unshare
before Python 3.12, glibc's mallopt), via ctypes.

Shared by both sides: the daemon marks itself non-dumpable, the zygote is a
child subreaper, workers set their parent-death signal and make an IPC
namespace of their own."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = [
    "is_dumpable",
    "large_allocations_mapped",
    "set_child_subreaper",
    "set_dumpable",
    "set_pdeathsig",
    "unshare_ipc",
]

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWIPC = 0x08000000

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _prctl(option: int, arg: int = 0) -> int:
    result: int = _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def set_child_subreaper() -> None:
    """Orphaned descendants re-parent to this process instead of to init,
    so they can still be found and reaped."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def set_dumpable(dumpable: bool) -> None:
    """PR_SET_DUMPABLE.  A non-dumpable process's /proc files (environ, mem,
    fd, maps...) belong to root and need CAP_SYS_PTRACE to open; ptrace needs
    it too; so another process of the same uid (a session's tools, when
    workers run as the daemon's user) cannot read its environment or memory.
    The kernel resets the flag on execve and on every change of credentials
    (setresuid, setresgid...): call it again after those."""
    _prctl(_PR_SET_DUMPABLE, 1 if dumpable else 0)


def is_dumpable() -> bool:
    return _prctl(_PR_GET_DUMPABLE) == 1




def unshare_ipc() -> str:
    """Move this process into a new IPC namespace (SysV shared memory,
    semaphores and message queues, POSIX message queues), which the kernel
    destroys with everything in it when its last process exits; '' when
    done, else why not (it takes CAP_SYS_ADMIN)."""
    if _libc.unshare(_CLONE_NEWIPC) != 0:
        return os.strerror(ctypes.get_errno())
    return ""


# glibc's mallopt(M_MMAP_THRESHOLD): -3.  Setting it also turns off glibc's
# dynamic threshold, which after one large mmapped buffer is freed serves
# the next ones from the heap, where freeing them gives nothing back.
_M_MMAP_THRESHOLD = -3


def large_allocations_mapped(threshold: int = 1 << 20) -> bool:
    """Allocations of `threshold` bytes and more each get a mapping of their
    own, unmapped when freed: a burst of clients' large buffers (64 half-sent
    16 MiB frames) goes back to the system once they end, instead of staying
    in the heap as the process's RSS.  False where the C library has no
    mallopt (not glibc)."""
    mallopt = getattr(_libc, "mallopt", None)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))
