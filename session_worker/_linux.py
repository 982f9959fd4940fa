"""The few Linux process controls Python does not wrap, via ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = [
    "RESOLVE_BENEATH",
    "RESOLVE_NO_MAGICLINKS",
    "is_dumpable",
    "openat2",
    "set_child_subreaper",
    "set_dumpable",
    "set_pdeathsig",
]

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08

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


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc.syscall.restype = ctypes.c_long


def openat2(dir_fd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    """openat2(2) (Linux 5.6): open `path` relative to `dir_fd` with the
    `resolve` restrictions applied by the kernel during the lookup itself.
    OSError(ENOSYS) on older kernels or where seccomp hides it.  Blocks in
    the kernel with the GIL released (ctypes)."""
    # The kernel refuses a mode without O_CREAT or O_TMPFILE (whose bits
    # include O_DIRECTORY's, hence the full comparison).
    creates = bool(flags & os.O_CREAT) or flags & os.O_TMPFILE == os.O_TMPFILE
    how = _OpenHow(flags, mode if creates else 0, resolve)
    fd: int = _libc.syscall(
        ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(path),
        ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd
