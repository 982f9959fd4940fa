"""A session's disk: how its workspace's size is capped (`max_disk_mb`).

Runs in the daemon: `detect` once at start, on the loop; `DiskWalk.step` in
the measuring thread (`supervisor.core.measure`), never on the loop.

Two paths, chosen once at start and said in the start-up log and `stats`
(`disk_quota`):

- "kernel" (btrfs with quotas enabled, and a daemon that may set a qgroup
  limit: CAP_SYS_ADMIN): every new workspace is a subvolume whose qgroup is
  limited to `max_disk_mb` (`supervisor.core.btrfs`).  A write past it fails
  with EDQUOT at once, `fallocate` included, and the session goes on: a
  full workspace, as on a full disk.  The walk below stays on as a backstop
  (a workspace made before quotas were on is a plain directory).
- "measured" (every other filesystem, and btrfs without quotas or the
  capability; the start-up log says which and what to set): the sweep walks
  the workspace off the loop, every `DISK_EVERY_SECS` after the last walk
  ended (and at once for a worker that just started), a slice of
  `measure.WALK_ENTRIES` entries a sweep, and sums allocated blocks
  (st_blocks * 512: a 3 GiB fallocate'd file is 3 GiB even unwritten, a
  sparse one is what it holds), each inode once (hard links), never
  following a symlink nor crossing into another filesystem.  Past the cap
  the session is stopped (see `supervisor.core.sweep`): it may have
  overshot by what it wrote since the last walk.

ext4 and xfs project quotas are not used: this project's machines run a
kernel without CONFIG_QUOTA, where they cannot be tested; a filesystem
mounted with them is named in the log, and measured.

The walk is as good as paths are: an entry whose path is longer than the
kernel takes (PATH_MAX) is not reached, though the directories above it are
counted.  The kernel's quota has no such gap.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.core import btrfs

__all__ = ["DISK_EVERY_SECS", "DiskWalk", "QuotaPath", "detect"]

# Seconds between the end of one walk of a workspace and the start of the
# next: a filesystem walk is not free, and a workspace does not fill in
# 100 ms the way memory does (3 GiB written at 1 GB/s takes 3 s anyway).
DISK_EVERY_SECS = 3.0


@dataclass(slots=True, frozen=True)
class QuotaPath:
    kind: str  # "kernel" (btrfs qgroups) or "measured"
    detail: str  # for the log and `stats`
    # The workspaces' filesystem is btrfs: a subvolume made inside one is
    # another st_dev, and the walk goes into it all the same.
    subvolumes: bool = False

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


def detect(workspace_root: Path) -> QuotaPath:
    """Which path caps the workspaces under `workspace_root` (blocking:
    the btrfs probe makes and removes a subvolume)."""
    root = workspace_root
    while not root.exists() and root != root.parent:
        root = root.parent  # not created yet: its filesystem is its parent's
    mount = _mount_of(root.resolve())
    walked = "the workspace walked every few seconds"
    if mount is None:
        return QuotaPath("measured", f"{walked} (mounts unreadable)")
    point, fstype, opts = mount
    if fstype == "btrfs":
        if root != workspace_root:
            with contextlib.suppress(OSError):
                workspace_root.mkdir(parents=True, exist_ok=True)
        why = btrfs.probe(str(workspace_root))
        if not why:
            return QuotaPath("kernel", f"a btrfs subvolume per workspace, its qgroup limited ({point}); "
                                       "writes past the cap fail with EDQUOT", subvolumes=True)
        return QuotaPath("measured", f"{walked} (btrfs at {point}: {why})", subvolumes=True)
    if set(opts.split(",")) & {"prjquota", "pquota", "prjjquota"}:
        return QuotaPath("measured", f"{walked} ({fstype} at {point} has project quotas, which "
                                     "sessiond does not set: its kernel path is btrfs qgroups)")
    return QuotaPath("measured", f"{walked} ({fstype} at {point}: the kernel's cap needs btrfs "
                                 "with quotas enabled)")


@dataclass(slots=True)
class DiskWalk:
    """One walk of a workspace, in slices (in the measuring thread only,
    while the loop holds no reference it reads).

    A tool may swap a directory for a symlink while the walk is under way:
    each directory is opened with O_NOFOLLOW and read only if it is still
    the inode seen inside the workspace, and its entries are looked at
    relative to that open directory, so the walk never counts (nor shows
    in `disk_bytes`) anything outside the workspace."""

    root: str
    # On btrfs: go into subvolumes made inside the workspace (another
    # st_dev, the same filesystem), which a tool's own qgroup does not count.
    subvolumes: bool = False
    total: int = 0
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
            if entry is None:
                self.close()
                continue
            spent += 1
            self._count(entry)
        return spent

    def _open(self, path: str, dev: int, ino: int) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return  # gone, swapped for a symlink, or unreadable meanwhile: skip it
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
        except OSError:
            return
        if st.st_dev != self._dir_dev and not (self.subvolumes and btrfs.is_subvolume(st)):
            return  # another filesystem mounted or bound inside: not the workspace's
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in self._linked:
                return
            self._linked.add(key)
        self.total += st.st_blocks * 512
        if stat.S_ISDIR(st.st_mode):
            self._stack.append((f"{self._path}/{entry.name}", st.st_dev, st.st_ino))
