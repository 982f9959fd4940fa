"""The kernel's cap on a workspace's size, on btrfs: a subvolume per
workspace and a qgroup limit on it.

Runs in the daemon: `probe` once at start (on the loop, before any session
runs), `make_workspace`, `set_limit` and `destroy` where the workspace is
made and removed (`supervisor.core.workspaces`).

With quotas enabled on the filesystem (`btrfs quota enable`), every write
past a subvolume's "max referenced" fails with EDQUOT, at once: a tool's
`fallocate` of 3 GiB in a 2 GiB workspace is refused before a block of it is
taken, where the measured path (`supervisor.host.diskquota`) could only
stop the session after the fact.  Setting a limit takes CAP_SYS_ADMIN;
creating and removing a subvolume does not.  Nothing here runs btrfs-progs:
the five ioctls are the kernel's stable ABI (linux/btrfs.h), as the
seccomp filter's syscall numbers are.

A subvolume made inside the workspace is a qgroup of its own, outside the
workspace's limit: tools may not make one (the seccomp filter refuses the
subvolume and snapshot ioctls), and the walk that stays on as a backstop
counts any made by code outside the sandbox (`DiskWalk(subvolumes=True)`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct

__all__ = [
    "destroy", "is_subvolume", "make_workspace", "probe", "set_limit", "subvolume_id",
]

# linux/btrfs.h, as gcc computes them for x86-64 and every other Linux ABI
# with the generic _IOC layout.
_SUBVOL_CREATE = 0x5000940E
_SNAP_DESTROY = 0x5000940F
_INO_LOOKUP = 0xD0009412
_QGROUP_LIMIT = 0x8030942B
_VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args: __s64 fd; char name[4088]
_NAME_MAX = 4087
_FIRST_FREE_OBJECTID = 256  # a subvolume's root directory has this inode number
_LIMIT_MAX_RFER = 1
_NO_LIMIT = (1 << 64) - 1


def is_subvolume(st: os.stat_result) -> bool:
    """Whether a directory's stat is that of a subvolume's root (on btrfs)."""
    return stat.S_ISDIR(st.st_mode) and st.st_ino == _FIRST_FREE_OBJECTID


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if not raw or len(raw) > _NAME_MAX or b"/" in raw or b"\0" in raw:
        raise OSError(errno.EINVAL, f"not a subvolume name: {name!r}")
    buf = bytearray(_VOL_ARGS)
    buf[8 : 8 + len(raw)] = raw
    return buf


def make_workspace(parent: str, name: str) -> None:
    """Create `parent/name` as a subvolume (EEXIST if the name is taken)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _SUBVOL_CREATE, _vol_args(name))
    finally:
        os.close(fd)


def subvolume_id(fd: int) -> int:
    """The id of the subvolume that holds the open file `fd`."""
    buf = bytearray(4096)  # struct btrfs_ioctl_ino_lookup_args: treeid, objectid, name[4080]
    struct.pack_into("=QQ", buf, 0, 0, _FIRST_FREE_OBJECTID)
    fcntl.ioctl(fd, _INO_LOOKUP, buf)
    return int(struct.unpack_from("=Q", buf, 0)[0])


def set_limit(path: str, max_bytes: int | None) -> None:
    """Cap the subvolume at `path` to `max_bytes` referenced (None: no cap).
    Raises OSError: EPERM without CAP_SYS_ADMIN, ENOTCONN with quotas off,
    ENOTTY or EINVAL where `path` is not on btrfs."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not is_subvolume(os.fstat(fd)):
            raise OSError(errno.EINVAL, f"{path} is not a subvolume")
        qgroup = subvolume_id(fd)  # level 0: the qgroup id is the subvolume's
        # struct btrfs_ioctl_qgroup_limit_args: qgroupid, then btrfs_qgroup_limit
        # (flags, max_rfer, max_excl, rsv_rfer, rsv_excl).
        limit = _NO_LIMIT if max_bytes is None else max_bytes
        buf = bytearray(struct.pack("=QQQQQQ", qgroup, _LIMIT_MAX_RFER, limit, 0, 0, 0))
        fcntl.ioctl(fd, _QGROUP_LIMIT, buf)
    finally:
        os.close(fd)


def destroy(parent: str, name: str) -> bool:
    """Remove the subvolume `parent/name` whole (the kernel drops its
    blocks in the background).  False when it cannot be (not a subvolume,
    one nested in it, not btrfs): the caller removes it file by file."""
    try:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not is_subvolume(st) or st.st_dev == os.fstat(fd).st_dev:
            return False
        fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(name))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def probe(root: str) -> str:
    """'' when workspaces under `root` can each be a capped subvolume here;
    else why not, with what to do about it."""
    name = f".sessiond-quota-probe-{os.getpid()}"
    try:
        make_workspace(root, name)
    except OSError as exc:
        return f"cannot make a subvolume in {root}: {exc.strerror}"
    try:
        set_limit(os.path.join(root, name), 1 << 20)
    except OSError as exc:
        if exc.errno == errno.EPERM:
            return ("setting a qgroup limit needs CAP_SYS_ADMIN, which the daemon lacks: add it to "
                    "the unit's CapabilityBoundingSet= for the kernel's cap")
        if exc.errno in (errno.ENOTCONN, errno.ENOENT):
            return f"quotas are not enabled on it (btrfs quota enable {root})"
        return f"cannot set a qgroup limit: {exc.strerror}"
    finally:
        if not destroy(root, name):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(root, name))
    return ""
