"""A session's disk: how its workspace's size (`max_disk_mb`) and file
count (`max_disk_inodes`) are capped.

Runs in the daemon: `detect` once at start, on the loop; `DiskWalk.step` in
the measuring thread (`supervisor.host.measure`), never on the loop.

Three paths, chosen once at start (`[tools] disk_quota`: "auto" takes the
first that works here; "kernel" refuses to start without one of the first
two; "measured" is the walk alone) and said in the start-up log and `stats`
(`disk_quota`), with why the kernel's is not used where it is not:

- "kernel", btrfs qgroups (the workspace root on btrfs with quotas enabled,
  and a daemon that may set a qgroup limit: CAP_SYS_ADMIN): every new
  workspace is a subvolume whose qgroup is limited to `max_disk_mb`
  (`supervisor.host.btrfs`).  A write past it fails with EDQUOT at once,
  `fallocate` included, and the session goes on: a full workspace, as on a
  full disk.  btrfs has no inode table to run out of: a file's inode is
  metadata, counted in the qgroup with the rest.  The walk stays on as a
  backstop (a workspace made before quotas were on is a plain directory).
- "kernel", an image per workspace (a daemon with CAP_SYS_ADMIN and loop
  devices, on any other filesystem): each new workspace is an ext4
  filesystem of its own, a sparse image on a loop device mounted at the
  workspace's path (`supervisor.spawn.diskimage`), sized from
  `max_disk_mb` with an inode table of `max_disk_inodes`.  A write past
  either fails with ENOSPC at once, whatever holds the blocks: a file
  unlinked while held open, a directory nobody else can read.  Nothing is
  walked: the figures (`disk_bytes`, `disk_inodes`) are a statfs.
- "measured" (everything else; the log says what the kernel's cap would
  need): the sweep walks the workspace off the loop, every
  `DISK_EVERY_SECS` after the last walk ended (and at once for a worker
  that just started), a slice of `measure.WALK_ENTRIES` entries a sweep,
  and sums allocated blocks (st_blocks * 512: a 3 GiB fallocate'd file is
  3 GiB even unwritten, a sparse one is what it holds) and entries, each
  inode once (hard links), never following a symlink nor crossing into
  another filesystem.  Past either cap the session is stopped (see
  `supervisor.core.sweep`): it may have overshot by what it wrote since the
  last walk.  A directory the walk cannot read stops it as well (fail
  closed: what it holds cannot be counted).  What the walk cannot see at
  all: a file unlinked while a process holds it open.

ext4 and xfs project quotas are not used: this project's machines run a
kernel without CONFIG_QUOTA, where they cannot be tested; a filesystem
mounted with them is named in the log.

The walk is as good as paths are: an entry whose path is longer than the
kernel takes (PATH_MAX) is not reached, though the directories above it are
counted.  The kernel's caps have no such gap.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.host import btrfs
from supervisor.errors import StartupError
from supervisor.spawn import diskimage

__all__ = ["DISK_EVERY_SECS", "IMAGES", "DiskWalk", "QuotaPath", "detect"]

# Where the workspaces' images live, in the workspace root: no "@" in its
# name, so no session's workspace and never an orphan of one.
IMAGES = ".images"

# Seconds between the end of one walk of a workspace and the start of the
# next: a filesystem walk is not free, and a workspace does not fill in
# 100 ms the way memory does (3 GiB written at 1 GB/s takes 3 s anyway).
DISK_EVERY_SECS = 3.0


@dataclass(slots=True, frozen=True)
class QuotaPath:
    kind: str  # "kernel" (btrfs qgroups, or an image per workspace) or "measured"
    detail: str  # for the log and `stats`
    # The workspaces' filesystem is btrfs: a subvolume made inside one is
    # another st_dev, and the walk goes into it all the same.
    subvolumes: bool = False
    # Each new workspace is an image of its own (supervisor.spawn.diskimage).
    images: bool = False

    @property
    def kernel(self) -> bool:
        return self.kind == "kernel"

    def describe(self) -> str:
        return f"{self.kind}: {self.detail}"


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    """(mount point, fs type, super options) of the mount holding `path`."""
    best: tuple[str, str, str] | None = None
    target = str(path)
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                point = fields[4].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and (best is None or len(point) >= len(best[0])):
                    best = (point, fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else "")
    except (OSError, ValueError, IndexError):
        return None
    return best


def detect(workspace_root: Path, mode: str = "auto") -> QuotaPath:
    """Which path caps the workspaces under `workspace_root` (blocking:
    the btrfs probe makes and removes a subvolume, the image probe an image).
    Raises StartupError under `[tools] disk_quota = "kernel"` when neither
    of the kernel's can be had."""
    root = workspace_root
    while not root.exists() and root != root.parent:
        root = root.parent  # not created yet: its filesystem is its parent's
    walked = "the workspace walked every few seconds, files and blocks (it cannot see a file unlinked while held open)"
    mount = _mount_of(root.resolve())
    point, fstype, opts = mount if mount is not None else ("?", "?", "")
    if mode == "measured":
        return QuotaPath("measured", f'{walked} ([tools] disk_quota = "measured")', subvolumes=fstype == "btrfs")
    why_not: list[str] = []
    if fstype == "btrfs":
        if root != workspace_root:
            with contextlib.suppress(OSError):
                workspace_root.mkdir(parents=True, exist_ok=True)
        why = btrfs.probe(str(workspace_root))
        if not why:
            return QuotaPath("kernel", f"a btrfs subvolume per workspace, its qgroup limited ({point}); "
                                       "writes past the cap fail with EDQUOT", subvolumes=True)
        why_not.append(f"no btrfs qgroups at {point}: {why}")
    why = diskimage.probe(str(workspace_root / IMAGES))
    if not why:
        return QuotaPath("kernel", f"an ext4 image per workspace, loop-mounted ({fstype} at {point}); "
                                   "writes past max_disk_mb or max_disk_inodes fail with ENOSPC"
                                   + "".join(f" ({w})" for w in why_not),
                         subvolumes=fstype == "btrfs", images=True)
    why_not.append(f"no image per workspace: {why}")
    if set(opts.split(",")) & {"prjquota", "pquota", "prjjquota"}:
        why_not.append(f"{fstype} at {point} has project quotas, which sessiond does not set")
    if mode == "kernel":
        raise StartupError('[tools] disk_quota = "kernel", but the kernel cannot cap the workspaces here: '
                           + "; ".join(why_not))
    return QuotaPath("measured", f"{walked}; {'; '.join(why_not)}", subvolumes=fstype == "btrfs")


@dataclass(slots=True)
class DiskWalk:
    """One walk of a workspace, in slices (in the measuring thread only,
    while the loop holds no reference it reads): its blocks (`total`), its
    files and directories (`inodes`, the root not counted) and the first
    directory it could not read (`unreadable`, relative to the root).

    A tool may swap a directory for a symlink while the walk is under way:
    each directory is opened with O_NOFOLLOW and read only if it is still
    the inode seen inside the workspace, and its entries are looked at
    relative to that open directory, so the walk never counts (nor shows
    in `disk_bytes`) anything outside the workspace.

    A workspace that is an image of its own (`image`) is not walked: one
    statfs of its mount says all (and, should it not be mounted, it is
    walked after all)."""

    root: str
    # On btrfs: go into subvolumes made inside the workspace (another
    # st_dev, the same filesystem), which a tool's own qgroup does not count.
    subvolumes: bool = False
    image: bool = False
    statfs: bool = False  # the figures are its image's statfs (the kernel caps it)
    total: int = 0
    inodes: int = 0
    unreadable: str = ""
    done: bool = False
    # Directories to read: (path, device and inode seen when it was found).
    _stack: list[tuple[str, int, int]] = field(default_factory=list)
    _linked: set[tuple[int, int]] = field(default_factory=set)
    _started: bool = False
    # The directory being read (a huge one is read across several slices).
    _iter: os._ScandirIterator[str] | None = None
    _path: str = ""
    _dir_dev: int = -1  # its device: an entry on another is another filesystem's
    _fd: int = -1

    def step(self, budget: int) -> int:
        """Look at up to about `budget` entries; returns how many it did."""
        if self.done:
            return 0
        if not self._started:
            self._started = True
            try:
                st = os.lstat(self.root)
            except OSError:
                self.done = True  # no workspace (yet): nothing held
                return 1
            if not stat.S_ISDIR(st.st_mode):
                self.done = True
                return 1
            if self.image and self._statfs(st):
                return 1
            self.total += st.st_blocks * 512
            self._stack.append((self.root, st.st_dev, st.st_ino))
        spent = 0
        while spent < budget:
            if self._iter is None:
                if not self._stack:
                    self.done = True
                    break
                spent += 1
                self._open(*self._stack.pop())
                continue
            try:
                entry = next(self._iter, None)
            except OSError:
                entry = None
                self._cannot_read(self._path)
            if entry is None:
                self.close()
                continue
            spent += 1
            self._count(entry)
        return spent

    def _statfs(self, st: os.stat_result) -> bool:
        """The figures of a mounted image, from its filesystem; False when
        the root is no mount of its own (then it is walked)."""
        try:
            if os.lstat(os.path.dirname(self.root) or "/").st_dev == st.st_dev:
                return False
            vfs = os.statvfs(self.root)
        except OSError:
            return False
        self.total = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
        self.inodes = max(vfs.f_files - vfs.f_ffree - diskimage.RESERVED_INODES, 0)
        self.done = self.statfs = True
        return True

    def _cannot_read(self, path: str) -> None:
        if not self.unreadable:
            self.unreadable = os.path.relpath(path, self.root)

    def _open(self, path: str, dev: int, ino: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            # Gone or swapped for a symlink meanwhile: not the workspace's.
            # Unreadable: what it holds cannot be counted (fail closed).
            if exc.errno in (errno.EACCES, errno.EPERM):
                self._cannot_read(path)
            return
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (dev, ino):
                # Its entries' stat() are fstatat() on `fd`: open until close().
                self._iter, self._fd, self._path, self._dir_dev = os.scandir(fd), fd, path, dev
                return
        except OSError:
            pass
        os.close(fd)

    def close(self) -> None:
        """Let go of the directory being read (a walk cut short)."""
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _count(self, entry: os.DirEntry[str]) -> None:
        try:
            st = entry.stat(follow_symlinks=False)  # fstatat on the open directory
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                self._cannot_read(self._path)  # listable, not searchable (mode -x)
            return
        if st.st_dev != self._dir_dev and not (self.subvolumes and btrfs.is_subvolume(st)):
            return  # another filesystem mounted or bound inside: not the workspace's
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in self._linked:
                return
            self._linked.add(key)
        self.total += st.st_blocks * 512
        self.inodes += 1
        if stat.S_ISDIR(st.st_mode):
            self._stack.append((f"{self._path}/{entry.name}", st.st_dev, st.st_ino))
