"""Who is on the other end of a control-socket connection (daemon side).

Everything here comes from the socket itself or from /proc at accept time,
once per connection; nothing runs per request.

* `credentials()`: uid, primary gid and pid from SO_PEERCRED, supplementary
  groups from SO_PEERGROUPS.  The groups are the ones the peer had when it
  connected, read without opening a file, so they are right under EMFILE,
  under `ProtectProc=invisible`, and after the peer's pid has been reused
  (all three broke the old read of /proc/PID/status).
* `in_session()`: whether the peer is a session's process (its worker, its
  tools, escaped ones included), by what a tool cannot shed: its uid (one
  that only sessions run as), its PID namespace, its cgroup (a session's),
  and its ancestry (it descends from the zygote, the child subreaper of
  every session process, so an orphan re-parents to it, never past it).
  The ancestry is walked through pidfds (PIDFD_GET_INFO), which
  `ProtectProc=invisible` and a non-dumpable process do not hide; through
  /proc/PID/stat on kernels before 6.13.  Whatever cannot be read counts
  as inside for a uid that sessions can run as, and never against any
  other uid.  The peer's pidfd, taken first and probed last, proves that
  the pid read about was the peer's throughout.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import os
import signal
import socket
import struct
from typing import Any, NamedTuple

# AncestryChanged is re-exported: the server catches peer.AncestryChanged.
from supervisor.errors import AncestryChanged, AncestryHidden, AncestryMoved
from supervisor.core.workspaces import SessionUids

__all__ = ["AncestryChanged", "PeerCredentials", "SessionUids", "credentials", "in_session", "session_cgroup"]

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


def in_session(sock: Any, cred: PeerCredentials, roots: frozenset[int], uids: SessionUids) -> str:
    """Why the peer counts as a session's process ('' when it does not):
    its uid is one only sessions run as; its PID namespace is not ours;
    its cgroup is a session's; it descends from one of `roots` (the
    zygote, and the daemon itself); or it exited before we could tell (its
    pid may name someone else by now: refusing costs nothing, it is gone).

    What cannot be read (a non-dumpable process under
    `ProtectProc=invisible`, an ancestor hidden the same way on a kernel
    without PIDFD_GET_INFO) counts as inside for a uid that sessions can
    run as, and is ignored for any other: such a peer was never a session's.

    Raises OSError when no pidfd or /proc file can be opened (EMFILE): the
    caller cannot tell and must not guess.  Raises AncestryChanged when the
    tree kept changing under the walk.
    """
    if uids.only_sessions(cred.uid):
        return f"uid {cred.uid} is a session's ([daemon] session_uid_range / worker_user)"
    pidfd = _peer_pidfd(sock, cred.pid)
    if pidfd is None:
        return "it exited before it could be checked"
    try:
        unknown: list[str] = []
        why = _signals(pidfd, cred.pid, roots, unknown, uids.could_be_session(cred.uid))
        # Alive now means the pid we read about was the peer throughout:
        # a pid is not reused while its process lives.
        try:
            signal.pidfd_send_signal(pidfd, 0)
        except ProcessLookupError:
            return "it exited before it could be checked"
        except PermissionError:
            pass  # alive, and not ours to signal (an unprivileged daemon, a root client)
        if why:
            return why
        if unknown and uids.could_be_session(cred.uid):
            return f"uid {cred.uid} may be a session's and {'; '.join(unknown)}"
        return ""
    finally:
        os.close(pidfd)


def _signals(pidfd: int, pid: int, roots: frozenset[int], unknown: list[str], sessions_uid: bool) -> str:
    """The first sign that the peer is a session's; what could not be read
    goes to `unknown`.  Another PID namespace is a sign only for a uid that
    sessions can run as (a sandbox's user namespace maps its tools to the
    daemon's uid): a client of any other uid in a container of its own,
    with the socket bound in, is a client."""
    if sessions_uid:
        if pid == 0:
            # SO_PEERCRED names a process of a namespace we cannot see as 0.
            return "it runs in another PID namespace"
        ns = _pid_namespace(str(pid))
        if ns is None:
            unknown.append("its PID namespace cannot be read")
        elif ns != (_pid_namespace("self") or ns):
            return "it runs in a PID namespace of its own"
    groups = _read_cgroups(pid)
    if groups is None:
        unknown.append("its cgroup cannot be read")
    elif where := session_cgroup(groups):
        return f"its cgroup {where} is a session's"
    try:
        if _descends_from(pidfd, pid, roots):
            return "it descends from the zygote"
    except AncestryHidden as exc:
        unknown.append(str(exc))
    return ""


def _pid_namespace(pid: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/pid")
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return None  # hidden (ENOENT), not ours to inspect (EACCES), or gone
    return st.st_dev, st.st_ino


def _read_cgroups(pid: int) -> list[str] | None:
    """The cgroup paths of `pid`, one per hierarchy (v1 and v2)."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            data = f.read(65536)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return None
    return [line.split(b":", 2)[2].decode(errors="replace") for line in data.splitlines() if line.count(b":") >= 2]


def session_cgroup(paths: list[str]) -> str:
    """The first of `paths` that is a session's cgroup, or ''.  Sessions
    live in `.../sessions/s-ID` (cgroup v2, supervisor.spawn.cgroups) or
    `.../sessiond/s-ID` (cgroup v1 hierarchies), and below."""
    for path in paths:
        parts = path.split("/")
        for above, part in zip(parts, parts[1:]):
            if part.startswith("s-") and above in ("sessions", "sessiond"):
                return path
    return ""


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


def _descends_from(pidfd: int, pid: int, roots: frozenset[int]) -> bool:
    for _ in range(_WALK_TRIES):
        try:
            found = _walk_pidfds(pidfd, pid, roots)
            return found if found is not None else _walk_proc(pid, roots)
        except AncestryMoved:
            continue
    raise AncestryChanged(f"the ancestry of pid {pid} kept changing while it was read")


# PIDFD_GET_INFO (Linux >= 6.13): a process's parent and credentials from
# its pidfd, without /proc, so neither hidepid nor a non-dumpable process
# hides them.  struct pidfd_info, first version: mask, cgroupid, then
# pid, tgid, ppid, the uids and gids, one spare u32.
_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, 64 bytes)
_PIDFD_INFO = struct.Struct("=QQ12I")
_PIDFD_INFO_PID = 1
_info_supported = True


def _ppid(pidfd: int) -> int | None:
    """The parent pid of a pidfd's process, None where the kernel cannot
    say.  Raises ProcessLookupError once it has exited."""
    global _info_supported
    if not _info_supported:
        return None
    buf = bytearray(_PIDFD_INFO.size)
    struct.pack_into("=Q", buf, 0, _PIDFD_INFO_PID)
    try:
        fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf, True)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise ProcessLookupError(exc.errno, exc.strerror) from None
        if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            _info_supported = False
            return None
        raise
    ppid: int = _PIDFD_INFO.unpack(buf)[4]
    return ppid


def _walk_pidfds(pidfd: int, pid: int, roots: frozenset[int]) -> bool | None:
    """The walk through pidfds; None where PIDFD_GET_INFO is missing."""
    fd = pidfd
    try:
        for _ in range(_MAX_DEPTH):
            if pid in roots:
                return True
            if pid <= 1:
                return False
            try:
                ppid = _ppid(fd)
            except ProcessLookupError:
                if fd == pidfd:
                    return False  # the peer itself: the caller's probe decides
                raise AncestryMoved from None
            if ppid is None:
                return None
            if ppid in roots:
                return True
            if ppid <= 1:
                return False  # init, or a parent outside our PID namespace
            try:
                parent = os.pidfd_open(ppid)
            except ProcessLookupError:
                raise AncestryMoved from None
            try:
                # Still its parent: the pidfd is of that very process, not
                # of one that took its pid after it exited (the child would
                # have been re-parented meanwhile).
                same = _ppid(fd) == ppid
            except ProcessLookupError:
                same = False
            if fd != pidfd:
                os.close(fd)
            fd = parent
            if not same:
                raise AncestryMoved
            pid = ppid
    finally:
        if fd != pidfd:
            os.close(fd)
    raise AncestryMoved


def _walk_proc(pid: int, roots: frozenset[int]) -> bool:
    """The walk through /proc/PID/stat, for kernels before 6.13."""
    child_start: int | None = None
    for _ in range(_MAX_DEPTH):
        if pid in roots:
            return True
        if pid <= 1:
            return False
        stat = _read_stat(pid)
        if stat is None:
            if child_start is None:
                raise AncestryHidden("its /proc entry cannot be read")
            try:
                os.close(os.pidfd_open(pid))
            except ProcessLookupError:
                raise AncestryMoved from None  # an ancestor exited: its children were re-parented
            raise AncestryHidden(f"its ancestor {pid} cannot be read in /proc")
        ppid, start = stat
        # A parent never starts after its child: if this "ancestor" did,
        # the real one exited and its pid was reused between our reads.
        if child_start is not None and start > child_start:
            raise AncestryMoved
        child_start = start
        pid = ppid
    raise AncestryMoved


def _read_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, starttime) of `pid`, None if it is gone or hidden."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError):
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
