"""A workspace as a filesystem of its own: a sparse ext4 image on a loop
device, mounted at the workspace's path.  The kernel's cap on a workspace
where btrfs quotas cannot be had (`supervisor.host.diskquota` decides which
cap holds; `supervisor.core.workspaces` says when to make, mount and remove
one; this module does the host's part).

Runs in the daemon, in threads (a create's `asyncio.to_thread`, `rm`'s, the
start-up sweep of orphans): mkfs is a process and a mount or an unmount may
wait on the disk, never on the loop.

Why an image: its size and its inode table are the kernel's to hold, so a
write past `max_disk_mb` or a file past `max_disk_inodes` fails with ENOSPC
at once, whatever holds it (a file unlinked while held open, a directory
the daemon could not read, a million empty files); no walk is needed.
What it costs the host is what was written (the file is sparse, and
`discard` gives freed blocks back as holes), a loop device and a mount
(the bench: bench/disk_images.py).

Every step is crash safe:

- an image is made as `NAME.img.new` and renamed to `NAME.img` only once it
  is mounted and ready: a daemon killed in between leaves a `.new` that the
  next attempt (or the sweep of orphans) throws away;
- the loop device is set up with LO_FLAGS_AUTOCLEAR: it detaches itself
  when its last user lets go (our descriptor if the mount never happened,
  else the mount), so a daemon killed between the loop and the mount, or a
  service whose mount namespace is torn down (the shipped unit:
  PrivateMounts=), leaves no loop device behind;
- an image is never mounted twice: a loop device already backing it is
  either the mount at the workspace (taken over after a restart: a root
  daemon outside systemd mounts in the host's namespace) or stale (cleared:
  LOOP_CLR_FD, deferred by the kernel until a still-open user lets go), and
  while one is still attached the mount is refused.

Setting up a loop device and mounting take CAP_SYS_ADMIN (and access to
/dev/loop-control and /dev/loopN); `probe` says whether this daemon has
them, by doing it once.  Nothing here runs losetup or mount(8): the loop
ioctls and mount(2) are the kernel's stable ABI (linux/loop.h), as
supervisor.host.btrfs uses btrfs's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import struct
import subprocess
import time

from supervisor.errors import NoLoopDevice

__all__ = [
    "BLOCK", "RESERVED_INODES", "capability", "holders", "image_size", "make", "mount",
    "mounted_from", "probe", "release_stale", "remove", "unmount",
]

BLOCK = 4096
# Inodes an empty ext4 filesystem holds (1-10 are reserved, the root among
# them; lost+found, the 11th, is removed once mounted).
RESERVED_INODES = 10
_JOURNAL = 4 << 20  # below 64 MiB no journal: its 4 MiB would be most of the cap
_GROUP = 32768 * BLOCK  # an ext4 block group with 4 KiB blocks
_INODE_SIZE = 256
_MKFS_TIMEOUT_SECS = 60.0
# How long a mount waits for a loop device that still backs the image from
# a mount that is going (a lazy unmount draining, a mount namespace whose
# last process is still exiting: the stop of a daemon just before, a
# worker killed a moment ago) before it refuses.
RELEASE_GRACE_SECS = 5.0

# linux/loop.h
_LOOP_SET_FD, _LOOP_CLR_FD, _LOOP_SET_STATUS64 = 0x4C00, 0x4C01, 0x4C04
_LOOP_CONFIGURE, _LOOP_CTL_GET_FREE = 0x4C0A, 0x4C82
_LO_FLAGS_AUTOCLEAR, _LO_FLAGS_DIRECT_IO = 4, 16
_LO_NAME_SIZE = 64
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 0x2, 0x4, 0x2
_CAP_SYS_ADMIN = 21
# discard: what a tool deletes goes back to the host as holes in the image;
# noinit_itable: no kernel thread zeroes inode tables the sparse file reads
# as zeros anyway; errors=remount-ro: a damaged image stops taking writes.
_OPTIONS = "discard,noinit_itable,errors=remount-ro"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str, path: str = "") -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path or None)


def capability() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (a loop device and a mount need it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _mkfs() -> str | None:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return shutil.which("mkfs.ext4", path=path)


def image_size(max_bytes: int, inodes: int) -> int:
    """The image's size in bytes for a filesystem whose files can hold about
    `max_bytes` (never more) and `inodes` files: the inode table, the
    bitmaps and the journal on top (what the kernel counts as overhead,
    taken low: the rest of it comes out of the cap), and ext4's reserve for
    its own metadata (2%, at most 4,096 blocks), which files never get."""
    data = max_bytes + inodes * _INODE_SIZE + (_JOURNAL if max_bytes >= 64 << 20 else 0)
    groups = data // _GROUP + 1
    base = data + groups * 2 * BLOCK  # a block bitmap and an inode bitmap a group
    reserve = min(base // BLOCK // 50, 4096) * BLOCK
    return -(-(base + reserve) // BLOCK) * BLOCK


def make(image: str, max_bytes: int, inodes: int) -> None:
    """A new sparse image at `image` (which must not exist), its root
    directory root's (the caller hands it over once mounted).  Raises
    OSError (mkfs's complaint in it)."""
    mkfs = _mkfs()
    if mkfs is None:
        raise OSError(errno.ENOENT, "mkfs.ext4 is not installed (e2fsprogs)")
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, image_size(max_bytes, inodes))
    finally:
        os.close(fd)
    journal = max_bytes >= 64 << 20
    extended = "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0"
    argv = [mkfs, "-q", "-F", "-b", str(BLOCK), "-I", str(_INODE_SIZE), "-N", str(inodes + RESERVED_INODES),
            "-m", "0", "-O", "^resize_inode" + ("" if journal else ",^has_journal"), "-E", extended]
    if journal:
        argv += ["-J", f"size={_JOURNAL >> 20}"]
    try:
        done = subprocess.run([*argv, image], capture_output=True, text=True, timeout=_MKFS_TIMEOUT_SECS,
                              check=False, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError) as exc:
        remove(image)
        raise OSError(errno.EIO, f"mkfs.ext4 did not run: {exc}") from exc
    if done.returncode != 0:
        remove(image)
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise OSError(errno.EIO, f"mkfs.ext4 failed: {why}")


def remove(image: str) -> None:
    """Delete the image (a loop device still backed by it keeps its blocks
    until it is let go)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(image)


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it (\\040 for a space...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, source) of every mount of this mount namespace."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            with contextlib.suppress(ValueError, IndexError):
                sep = fields.index("-")
                found.append((_unescape(fields[4]), _unescape(fields[sep + 2])))
    return found


def mounted_from(target: str) -> str | None:
    """The source of the topmost mount at `target` (e.g. /dev/loop3), None if none."""
    found = None
    for point, source in _mounts():
        if point == target:
            found = source  # later lines are mounted on top of earlier ones
    return found


def _backing(name: str) -> str:
    try:
        with open(f"/sys/block/{name}/loop/backing_file") as f:
            return f.read().rstrip("\n")
    except OSError:
        return ""


def holders(image: str) -> list[str]:
    """Loop devices (loopN) backed by `image` now."""
    want = os.path.realpath(image)
    try:
        names = [n for n in os.listdir("/sys/block") if n.startswith("loop")]
    except OSError:
        return []
    return sorted(n for n in names if _backing(n) == want)


def _clear(name: str) -> None:
    """Detach loop device `name` (deferred by the kernel while it is in use)."""
    with contextlib.suppress(OSError):
        fd = os.open(f"/dev/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, _LOOP_CLR_FD, 0)
        except OSError:
            pass
        finally:
            os.close(fd)


def _loop_config(fd: int, name: str, flags: int) -> bytes:
    # struct loop_config { __u32 fd; __u32 block_size; struct loop_info64 info; __u64 __reserved[8]; };
    # loop_info64: 5 x __u64, 4 x __u32 (lo_flags last), file name, crypt name, key, 2 x __u64.
    raw = name.encode()[: _LO_NAME_SIZE - 1]
    info = struct.pack("=5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0, flags, raw, b"", b"", 0, 0)
    return struct.pack("=II", fd, BLOCK) + info + bytes(64)


def _attach(image_fd: int, image: str) -> tuple[int, str]:
    """A free loop device backed by `image_fd`, autoclearing: (its open fd, loopN)."""
    try:
        control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise NoLoopDevice(f"/dev/loop-control cannot be opened: {exc.strerror}") from exc
    try:
        for _ in range(32):  # another process may take the free device first
            try:
                number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            except OSError as exc:
                raise NoLoopDevice(f"no free loop device ({exc.strerror})") from exc
            name = f"loop{number}"
            try:
                fd = os.open(f"/dev/{name}", os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError as exc:
                raise NoLoopDevice(f"/dev/{name} is missing (no devtmpfs here?)") from exc
            try:
                _configure(fd, image_fd, image)
                return fd, name
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EBUSY:
                    raise
        raise NoLoopDevice("every free loop device was taken by another process first (32 tries)")
    finally:
        os.close(control)


def _configure(fd: int, image_fd: int, image: str) -> None:
    try:
        fcntl.ioctl(fd, _LOOP_CONFIGURE, _loop_config(image_fd, image, _LO_FLAGS_AUTOCLEAR | _LO_FLAGS_DIRECT_IO))
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise  # EBUSY: taken meanwhile
    # Direct I/O refused by the file's filesystem (or no LOOP_CONFIGURE,
    # Linux < 5.8): buffered, in two steps.
    try:
        fcntl.ioctl(fd, _LOOP_CONFIGURE, _loop_config(image_fd, image, _LO_FLAGS_AUTOCLEAR))
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTTY):
            raise
    fcntl.ioctl(fd, _LOOP_SET_FD, image_fd)
    try:
        fcntl.ioctl(fd, _LOOP_SET_STATUS64, _loop_config(0, image, _LO_FLAGS_AUTOCLEAR)[8:8 + 232])
    except OSError:
        fcntl.ioctl(fd, _LOOP_CLR_FD, 0)
        raise


def mount(image: str, target: str) -> bool:
    """Mount `image` at the directory `target` (a path the daemon made, in
    a directory only it writes).  True if it mounted it now, False if it
    was mounted there already (a daemon restarted outside systemd).
    Raises NoLoopDevice, or OSError."""
    for name in holders(image):
        if mounted_from(target) == f"/dev/{name}":
            return False
        _clear(name)  # a daemon killed before its mount: not autocleared yet
    # A cleared device goes when its last user lets go: the mount of a
    # stopped daemon still draining (unmounted lazily), a copy of it in a
    # mount namespace whose last process is still exiting.  Mounting the
    # image again meanwhile would have two filesystems write one image, so
    # wait for them, a while; a holder that stays is a refusal naming it.
    deadline = time.monotonic() + RELEASE_GRACE_SECS
    pause = 0.005
    while (held := holders(image)) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
    if held:
        raise OSError(errno.EBUSY, f"{image} is still in use by loop device(s) {', '.join(held)} "
                                   f"{RELEASE_GRACE_SECS:g}s after it was released (mounted in another "
                                   "mount namespace?)")
    if mounted_from(target) is not None:
        raise OSError(errno.EBUSY, f"{target} is already a mount point of something else")
    image_fd = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        loop_fd, name = _attach(image_fd, image)
    finally:
        os.close(image_fd)  # the loop device holds the file now
    try:
        # By descriptor, not by path: nothing on the way is followed.
        where = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            _check(_libc.mount(f"/dev/{name}".encode(), f"/proc/self/fd/{where}".encode(), b"ext4",
                               ctypes.c_ulong(_MS_NOSUID | _MS_NODEV), _OPTIONS.encode()), "mount", target)
        finally:
            os.close(where)
    finally:
        os.close(loop_fd)  # the mount holds it now; never mounted, it is cleared (autoclear)
    return True


def unmount(target: str, images: tuple[str, ...]) -> bool:
    """Unmount the mount at `target` if it is one of `images`' (lazily if
    something still holds a file in it: it goes, and its loop device with
    it, when that lets go).  False if none of them was mounted there."""
    source = mounted_from(target)
    names = {f"/dev/{n}" for image in images for n in holders(image)}
    if source is None or source not in names:
        return False
    if _libc.umount2(target.encode(), 0) != 0:
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            return False  # not mounted after all (gone meanwhile)
        if err != errno.EBUSY:
            raise OSError(err, f"umount: {os.strerror(err)}", target)
        _check(_libc.umount2(target.encode(), _MNT_DETACH), "umount (lazy)", target)
    return True


def release_stale(images_dir: str) -> list[str]:
    """Detach loop devices backed by an image under `images_dir` that is
    mounted nowhere in this namespace (a daemon killed between its loop
    and its mount on a kernel that did not clear it); returns their names."""
    mounted = {source for _, source in _mounts()}
    base = os.path.realpath(images_dir).rstrip("/") + "/"
    try:
        names = [n for n in os.listdir("/sys/block") if n.startswith("loop")]
    except OSError:
        return []
    stale = [n for n in names if _backing(n).startswith(base) and f"/dev/{n}" not in mounted]
    for name in stale:
        _clear(name)
    return stale


def probe(images_dir: str) -> str:
    """'' when workspaces can be images here (checked by making, mounting
    and removing a small one in `images_dir`); else why not, and what to do."""
    if not capability():
        return ("the daemon lacks CAP_SYS_ADMIN, which a loop device and a mount need (the shipped "
                "unit keeps it; an unprivileged daemon cannot have it)")
    if not os.path.exists("/dev/loop-control"):
        return "no loop devices (/dev/loop-control: modprobe loop)"
    if _mkfs() is None:
        return "mkfs.ext4 is not installed (apt-get install e2fsprogs)"
    try:
        os.makedirs(images_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot make {images_dir}: {exc.strerror}"
    name = os.path.join(images_dir, f".probe-{os.getpid()}")
    image, target = name + ".img", name + ".mnt"
    try:
        remove(image)
        with contextlib.suppress(FileExistsError):
            os.mkdir(target, 0o700)
        make(image, 1 << 20, 16)
        mount(image, target)
        unmount(target, (image,))
    except (OSError, NoLoopDevice) as exc:
        return f"a workspace image could not be made and mounted: {exc}"
    finally:
        remove(image)
        with contextlib.suppress(OSError):
            os.rmdir(target)
    return ""
