"""Who is on the other end of a control-socket connection (daemon side).

Everything here comes from the socket itself or from /proc at accept time,
once per connection; nothing runs per request.

* `credentials()`: uid, primary gid and pid from SO_PEERCRED, supplementary
  groups from SO_PEERGROUPS.  The groups are the ones the peer had when it
  connected, read without opening a file, so they are right under EMFILE,
  under `ProtectProc=invisible`, and after the peer's pid has been reused
  (all three broke the old read of /proc/PID/status).
* `in_session()`: whether the peer descends from the zygote, i.e. is a
  session's worker or one of its tools (escaped ones included: the zygote is
  their child subreaper, so an orphan re-parents to it, never past it).  The
  ancestry is walked through /proc/PID/stat; a pidfd taken before the walk
  and probed after it proves that the pid we walked from was still the peer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import signal
import socket
import struct
from typing import Any, NamedTuple

__all__ = ["PeerCredentials", "credentials", "in_session"]

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
_UCRED = struct.Struct("3i")
_GID = struct.Struct("I")
_NGROUPS_MAX = 65536
_PY_MAX_OPTLEN = 1024  # Python's getsockopt refuses a larger buffer: 256 groups
# A chain longer than this is not a process tree any more (pid reuse while
# we read); real ones are a dozen deep.
_MAX_DEPTH = 1024
# An ancestor that exits during the walk re-parents its children; walking
# again from the peer sees the new tree.  Past this many tries we give up.
_WALK_TRIES = 3


class PeerCredentials(NamedTuple):
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # supplementary, not including gid


class AncestryChanged(Exception):
    """The peer's ancestry kept changing while it was being walked."""


def credentials(sock: Any) -> PeerCredentials:
    """SO_PEERCRED + SO_PEERGROUPS of a connected Unix socket (a socket or
    uvloop's pseudo-socket; both offer getsockopt)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCredentials(pid, uid, gid, frozenset(_peer_groups(sock)))


def _peer_groups(sock: Any) -> list[int]:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, _PY_MAX_OPTLEN)
    except OSError as exc:
        # ERANGE: more groups than Python's getsockopt can take a buffer for.
        if exc.errno != errno.ERANGE:
            raise
        raw = _peer_groups_large(sock.fileno())
    return [g for (g,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size])]


def _peer_groups_large(fd: int) -> bytes:
    """getsockopt through libc, which (unlike Python's, capped at 1024
    bytes) takes any buffer, and on ERANGE says how big it must be."""
    size = ctypes.c_uint32(_NGROUPS_MAX * _GID.size)
    buf = ctypes.create_string_buffer(size.value)
    if _libc().getsockopt(fd, socket.SOL_SOCKET, _SO_PEERGROUPS, buf, ctypes.byref(size)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: size.value]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def in_session(sock: Any, pid: int, roots: frozenset[int]) -> bool:
    """True if the peer process `pid` descends from one of `roots` (the
    zygote, and the daemon itself), or if it exited before we could tell
    (its pid may already name someone else: refusing costs nothing, since
    it is gone).

    Raises OSError when no pidfd or /proc file can be opened (EMFILE): the
    caller cannot tell and must not guess.  Raises AncestryChanged when the
    tree kept changing under the walk.
    """
    pidfd = _peer_pidfd(sock, pid)
    if pidfd is None:
        return True  # already gone
    try:
        inside = _descends_from(pid, roots)
        # Alive now means the pid we walked from was the peer throughout:
        # a pid is not reused while its process lives.
        try:
            signal.pidfd_send_signal(pidfd, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, and not ours to signal (an unprivileged daemon, a root client)
        return inside
    finally:
        os.close(pidfd)


def _peer_pidfd(sock: Any, pid: int) -> int | None:
    try:
        # The kernel's reference to the very process that connected, so a
        # peer that exited and whose pid was reused is still detected.
        fd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
        assert isinstance(fd, int)
        return fd
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        if exc.errno == errno.ESRCH:
            return None
        # ENOPROTOOPT before Linux 6.5: open by pid, which leaves a window
        # between connect() and here for the pid to be reused.
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _descends_from(pid: int, roots: frozenset[int]) -> bool:
    for _ in range(_WALK_TRIES):
        try:
            return _walk(pid, roots)
        except _Retry:
            continue
    raise AncestryChanged(f"the ancestry of pid {pid} kept changing while it was read")


class _Retry(Exception):
    pass


def _walk(pid: int, roots: frozenset[int]) -> bool:
    child_start: int | None = None
    for _ in range(_MAX_DEPTH):
        if pid in roots:
            return True
        if pid <= 1:
            return False
        stat = _read_stat(pid)
        if stat is None:
            if child_start is None:
                return False  # the peer itself: the pidfd probe decides
            raise _Retry  # an ancestor exited: its children were re-parented
        ppid, start = stat
        # A parent never starts after its child: if this "ancestor" did,
        # the real one exited and its pid was reused between our reads.
        if child_start is not None and start > child_start:
            raise _Retry
        child_start = start
        pid = ppid
    raise _Retry


def _read_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, starttime) of `pid`, None if it is gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        data = os.read(fd, 1024)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)
    # "pid (comm) state ppid ... starttime ...": comm may hold spaces and
    # parentheses, so split after its last ')'.  starttime is field 22.
    fields = data[data.rfind(b")") + 2 :].split()
    return int(fields[1]), int(fields[19])
