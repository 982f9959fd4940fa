"""The daemon's freed heap given back to the kernel.  Runs in the daemon's
loop (the sweep asks, every `TRIM_EVERY_SECS`).

glibc keeps what Python frees above its small-object allocator (buffers
of frames, encoded records, a registry's table as it grows) for the next
allocation; in a daemon that creates and hibernates sessions all day that
is kilobytes per session held as RSS after the objects are gone (measured:
about 4.5 KiB per session made and hibernated, in-process).
`malloc_trim(0)` returns the free pages: a millisecond on a heap of tens of
MiB, a tenth of one when there is little to give back.  A C library
without it (musl): nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["TRIM_EVERY_SECS", "give_back_freed"]

TRIM_EVERY_SECS = 10.0


def _trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_MALLOC_TRIM = _trim()


def give_back_freed() -> None:
    """The free pages of the C heap returned to the kernel (RSS down)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
