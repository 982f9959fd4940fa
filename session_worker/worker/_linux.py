"""openat2(2), which Python does not wrap, via ctypes (the file tools)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["RESOLVE_BENEATH", "RESOLVE_NO_MAGICLINKS", "openat2"]

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified table)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


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
