"""File access confined to a directory by the kernel, for the file tools.

Runs in the worker, on a thread (`asyncio.to_thread`): every call here blocks.

Why not "resolve the path, check it, then open it": between the check and
the open, a session's own tool can swap a directory for a symlink (rename
with RENAME_EXCHANGE is atomic) and the open follows it out of the
workspace; measured before this module, 31 reads in 320 returned the file
outside.  Here the path is resolved and opened in one step relative to a
directory fd of the workspace:

- `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)` (Linux 5.6): the kernel
  refuses, during the lookup itself, any step that leaves the directory
  (`..` above it, an absolute symlink, a symlink leading out) with EXDEV,
  and /proc magic links (`/proc/self/root`, `/proc/PID/fd/N`) with ELOOP;
  symlinks that stay inside are followed.
- Without openat2 (ENOSYS: an old kernel, or a seccomp filter that hides
  it): a walk one component at a time with O_NOFOLLOW, each directory
  opened relative to the fd of the one before.  Stricter: it refuses every
  symlink (ELOOP) and every `..`.

Errors are OSErrors; EXDEV and ELOOP mean "leaves the workspace" and the
caller words them.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from session_worker.worker._linux import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, openat2

__all__ = [
    "ESCAPE_ERRNOS",
    "Entry",
    "list_beneath",
    "open_beneath",
    "read_beneath",
    "root_fd",
    "write_beneath",
]

ESCAPE_ERRNOS = frozenset({errno.EXDEV, errno.ELOOP})
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
# openat2 fails with EAGAIN when a rename anywhere on the system races a
# `..` lookup under RESOLVE_BENEATH; retrying is what the man page advises.
_EAGAIN_TRIES = 32

# None: not tried yet.  Tests set False to exercise the walk.
use_openat2: bool | None = None


@contextmanager
def root_fd(path: str | os.PathLike[str]) -> Iterator[int]:
    """An O_PATH fd of the workspace, closed on exit."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0o666) -> int:
    """Open `rel` (relative; "" or "." for the directory itself) beneath
    `dir_fd`; the new fd is close-on-exec."""
    global use_openat2
    flags |= os.O_CLOEXEC
    path = rel or "."
    if use_openat2 is not False:
        for _ in range(_EAGAIN_TRIES):
            try:
                fd = openat2(dir_fd, path, flags, mode, _RESOLVE)
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    continue
                if exc.errno == errno.ENOSYS:
                    use_openat2 = False
                    break
                raise
            use_openat2 = True
            return fd
        else:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), rel)
    return _walk(dir_fd, path, flags, mode)


def _walk(dir_fd: int, path: str, flags: int, mode: int) -> int:
    if path.startswith("/"):
        raise OSError(errno.EXDEV, "absolute path", path)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EXDEV, "'..' is not followed", path)
    if not parts:
        return os.open(".", flags, mode, dir_fd=dir_fd)
    opened: list[int] = []
    try:
        cur = dir_fd
        for name in parts[:-1]:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            opened.append(fd)
            kind = os.fstat(fd).st_mode
            if stat.S_ISLNK(kind):
                raise OSError(errno.ELOOP, "symlinks are not followed", path)
            if not stat.S_ISDIR(kind):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            cur = fd
        # O_NOFOLLOW: a symlink as the last component fails with ELOOP (or,
        # with O_PATH, opens the link itself, checked below).
        fd = os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=cur)
        if flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.ELOOP, "symlinks are not followed", path)
        return fd
    finally:
        for fd in opened:
            os.close(fd)


def read_beneath(dir_fd: int, rel: str, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes of a regular file, and its size."""
    # O_NONBLOCK: a FIFO planted in the workspace must not hang the open.
    fd = open_beneath(dir_fd, rel, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), rel)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", rel)
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return b"".join(chunks), st.st_size
    finally:
        os.close(fd)


def write_beneath(dir_fd: int, rel: str, data: bytes) -> None:
    """Create or replace a file, creating its parent directories."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts:
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), rel)
    # Each parent is created inside a directory opened beneath the root
    # (mkdirat never follows a symlink in the last component), and the next
    # level is opened beneath the root again, so a swapped-in symlink is
    # caught by the same rule as everywhere else.
    for depth in range(len(parts) - 1):
        parent = open_beneath(dir_fd, "/".join(parts[:depth]), os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(parts[depth], 0o777, dir_fd=parent)
        except FileExistsError:
            pass
        finally:
            os.close(parent)
    fd = open_beneath(dir_fd, "/".join(parts), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOCTTY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    kind: str  # "dir", "link" or "file"
    size: int


def list_beneath(dir_fd: int, rel: str) -> list[Entry]:
    """A directory's entries, sorted by name.  Nothing is followed: a
    symlink is reported as one, never stat'ed through."""
    fd = open_beneath(dir_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries: list[Entry] = []
        with os.scandir(fd) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed meanwhile
                if stat.S_ISLNK(st.st_mode):
                    entries.append(Entry(e.name, "link", 0))
                elif stat.S_ISDIR(st.st_mode):
                    entries.append(Entry(e.name, "dir", 0))
                else:
                    entries.append(Entry(e.name, "file", st.st_size))
        entries.sort(key=lambda x: x.name)
        return entries
    finally:
        os.close(fd)
