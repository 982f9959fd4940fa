"""The few Linux process controls Python does not wrap, via ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

__all__ = ["set_child_subreaper", "set_pdeathsig"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def set_child_subreaper() -> None:
    """Orphaned descendants re-parent to this process instead of to init,
    so they can still be found and reaped."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
