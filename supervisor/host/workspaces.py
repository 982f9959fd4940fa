"""A session's workspace on disk: made (a directory, a btrfs subvolume
with its qgroup limited, or an ext4 image mounted at its path), found
again, and removed whole.

Runs in the daemon: `prepare` and `remove` in a thread of the caller's
(`asyncio.to_thread`: an image is made by a process, a workspace can be
large), the rest on the loop at start and stop.  What to make and for
whom is decided by supervisor.core.workspaces (the session's uid, the
path, which workspaces are orphans); this module does it, never through a
link, and chowns only a directory it made itself.  The disk cap's path
(btrfs, an image, or measured) was found at start by
supervisor.host.diskquota.detect.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ipc.settings import LimitsSettings
from supervisor.errors import Capacity, Internal, NoLoopDevice
from supervisor.host import btrfs
from supervisor.host.diskquota import IMAGES, QuotaPath
from supervisor.logtag import tagged
from supervisor.spawn import diskimage
from supervisor.spawn.ceilings import fork_refusal

__all__ = ["WorkspaceDisk", "dir_owner", "open_dirs", "owns_an_entry", "rmtree"]

log = logging.getLogger("sessiond.manager")


class WorkspaceDisk:
    def __init__(self, quota: QuotaPath, root: Callable[[], Path]) -> None:
        self.quota = quota
        self._root = root  # the workspaces' root, as the config says now

    def prepare(self, session_id: str, workspace: Path, run_as: tuple[int, int] | None,
                limits: LimitsSettings) -> Path:
        """Create the session's workspace (0700, owned by whoever its worker
        runs as), or mount its image again.  Only a directory the daemon
        itself named and created is chowned: never one that was already
        there, never through a link.  Blocking (an image is made by a
        process): the workers call it in a thread.  Raises Capacity (no
        loop device) or Internal where its image cannot be made or mounted:
        a session never runs in an uncapped workspace the operator was told
        is capped."""
        made = False
        try:
            workspace.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._make(workspace)
                made = True
            except FileExistsError:
                st = os.lstat(workspace)
                if not stat.S_ISDIR(st.st_mode):
                    raise OSError(f"{workspace} exists and is not a directory") from None
                if run_as is not None and st.st_uid != run_as[0]:
                    raise OSError(
                        f"{workspace} belongs to uid {st.st_uid}, not to the session's uid {run_as[0]}"
                    ) from None
            else:
                if run_as is not None:
                    os.lchown(workspace, *run_as)
            if self.quota.kernel and not self.quota.images:
                self._cap(session_id, workspace, limits.max_disk_mb)
        except OSError as exc:
            tagged(log, session_id).warning("cannot prepare workspace %s: %s", workspace, exc)
            return workspace
        if self.quota.images:
            self._mount(session_id, workspace, run_as, made, limits)
        return workspace

    def _make(self, workspace: Path) -> None:
        if not self.quota.kernel or self.quota.images:
            os.mkdir(workspace, 0o700)
            return
        btrfs.make_workspace(str(workspace.parent), workspace.name)
        os.chmod(workspace, 0o700)  # made as the umask says; nobody has used it yet

    def _cap(self, session_id: str, workspace: Path, cap: int | None) -> None:
        """The kernel's cap at the session's max_disk_mb, set again at every
        start (a restart after a config change takes the new figure)."""
        try:
            btrfs.set_limit(str(workspace), None if cap is None else cap << 20)
        except OSError as exc:
            # A workspace made before quotas were on is a plain directory:
            # the walk alone holds it (supervisor.host.diskquota).
            tagged(log, session_id).warning(
                "workspace %s: the kernel's disk cap could not be set (%s); max_disk_mb is measured "
                "for this session instead (a workspace made before btrfs quotas were on is not a "
                "subvolume)", workspace, exc.strerror or exc)

    def _image(self, name: str) -> str:
        return str(self._root() / IMAGES / f"{name}.img")

    def _mount(self, session_id: str, workspace: Path, run_as: tuple[int, int] | None, made: bool,
               limits: LimitsSettings) -> None:
        """The workspace as an image of its own: made at its first start
        (sized from the session's max_disk_mb and max_disk_inodes then),
        mounted again at a start after the daemon's (a restart of the
        shipped unit took its mount namespace, and the mount, with it)."""
        image = self._image(workspace.name)
        where = str(workspace)
        try:
            if os.path.exists(image):
                diskimage.mount(image, where)
                return
            new = image + ".new"
            diskimage.unmount(where, (new,))  # a daemon killed before the rename below
            diskimage.remove(new)
            if limits.max_disk_mb is None:
                return  # no quota: a plain directory (the walk counts max_disk_inodes)
            if not made and _holds_files(workspace):
                tagged(log, session_id).warning(
                    "workspace %s was made before workspace images were on: it stays a plain "
                    "directory, measured (a new session gets an image)", workspace)
                return
            os.makedirs(os.path.dirname(image), mode=0o700, exist_ok=True)
            cap = limits.max_disk_mb << 20
            inodes = limits.max_disk_inodes if limits.max_disk_inodes is not None else cap // 16384
            diskimage.make(new, cap, inodes)
            try:
                diskimage.mount(new, where)
                # Its root is still root's and nobody has used it: 0700, no
                # lost+found in the user's way (e2fsck makes one when it
                # needs it), then the session's.
                os.chmod(workspace, 0o700)
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(workspace / "lost+found")
                if run_as is not None:
                    os.lchown(workspace, *run_as)
                os.rename(new, image)  # made and mounted: from now on it is the workspace
            except BaseException:
                diskimage.unmount(where, (new,))
                diskimage.remove(new)
                raise
        except NoLoopDevice as exc:
            raise Capacity(f"no loop device for the session's workspace image: {exc} (the host's loop "
                           "devices, or [tools] disk_quota = \"measured\")") from exc
        except OSError as exc:
            if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in (errno.EAGAIN, errno.ENOMEM):
                # mkfs could not be started at the task or memory ceiling: a
                # refusal to try again, as a worker's fork is (ceilings.fork_refusal).
                raise Capacity(fork_refusal(exc.__cause__.errno, "mkfs.ext4 for its workspace image "
                                            "could not be started")) from exc
            tagged(log, session_id).error("workspace %s: its disk image could not be made or mounted: %s",
                                          workspace, exc)
            raise Internal(f"its workspace's disk image could not be made or mounted: {exc.strerror or exc}") \
                from exc

    def remove(self, path: Path) -> None:
        """A workspace and its image, gone.  Blocking: call from a thread, a
        workspace can be large."""
        # An image is unmounted (lazily if a file of it is still held open:
        # it goes when that lets go) and deleted first: what is left is
        # the empty directory it was mounted on.  A subvolume goes whole
        # (its blocks freed by the kernel after); one that cannot (a
        # subvolume nested in it) file by file.
        image = self._image(path.name)
        diskimage.unmount(str(path), (image, image + ".new"))
        diskimage.remove(image)
        diskimage.remove(image + ".new")
        if not (self.quota.subvolumes and btrfs.destroy(str(path.parent), path.name)):
            rmtree(path)

    def close(self) -> None:
        """At the daemon's stop, once its workers are gone: unmount every
        workspace image, so that a daemon outside systemd leaves no mount
        behind (the next start mounts each again at its session's start)."""
        if not self.quota.images:
            return
        images = self._root() / IMAGES
        with contextlib.suppress(OSError):
            for entry in os.scandir(images):
                if entry.name.endswith(".img"):
                    with contextlib.suppress(OSError):
                        diskimage.unmount(str(self._root() / entry.name[:-4]), (entry.path,))

    def names(self) -> set[str] | None:
        """Every workspace ("ID@TOKEN") under the root, and every one an
        image names; None when the root cannot be listed."""
        root = self._root()
        names: set[str] = set()
        with contextlib.suppress(OSError):
            for entry in os.scandir(root / IMAGES):
                name = entry.name.removesuffix(".new").removesuffix(".img")
                if "@" in name and not entry.name.startswith(".probe-"):
                    names.add(name)
        try:
            entries = list(os.scandir(root))
        except OSError:
            return None
        return names | {e.name for e in entries if "@" in e.name and e.is_dir(follow_symlinks=False)}

    def release_stale(self) -> None:
        """Loop devices a killed daemon left attached to an image nothing mounts."""
        if self.quota.images:
            for loop in diskimage.release_stale(str(self._root() / IMAGES)):
                log.warning("detached loop device %s: it held a workspace image that nothing mounted "
                            "(a daemon killed while mounting it)", loop)


def open_dirs(sessions_dir: Path, state_dir: Path, workspaces: Path | None) -> None:
    """The sessions' directory (private); with `workspaces` (workers that run
    as another user must reach their workspace), the workspace root made and
    the state directory and it opened to traversal (0711: searched, not listed)."""
    sessions_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if workspaces is not None:
        workspaces.mkdir(parents=True, exist_ok=True)
        workspaces.chmod(0o711)
        state_dir.chmod(0o711)


def dir_owner(path: Path) -> int | None:
    """The uid that owns the directory `path` (None: not a directory).
    Raises FileNotFoundError, or OSError where it cannot be looked at."""
    st = os.lstat(path)
    return st.st_uid if stat.S_ISDIR(st.st_mode) else None


def owns_an_entry(root: Path, uid: int) -> bool:
    """Whether `uid` owns anything right beneath `root` (True when that
    cannot be told: not believed)."""
    try:
        with os.scandir(root) as entries:
            return any(e.stat(follow_symlinks=False).st_uid == uid for e in entries)
    except FileNotFoundError:
        return False  # no workspace at all yet
    except OSError:
        return True  # cannot tell: not believed


def _holds_files(directory: Path) -> bool:
    with os.scandir(directory) as inside:
        return any(inside)


def rmtree(path: Path) -> None:
    """Remove a tree that a session's tools may have made hard to remove
    (directories without write or search permission); never follows links."""

    opened: set[str] = set()  # each made listable once: no second try, no endless recursion

    def onerror(func: Any, target: str, exc_info: Any) -> None:
        exc = exc_info[1]
        if isinstance(exc, FileNotFoundError):
            return
        if not isinstance(exc, PermissionError):
            raise exc
        changed = False
        for directory in (os.path.dirname(target), target):
            if os.path.isdir(directory) and not os.path.islink(directory):
                try:
                    os.chmod(directory, 0o700)
                    changed = True
                except OSError:
                    pass
        if not changed:
            raise exc  # not ours to open up (no CAP_FOWNER): say so, once
        if func in (os.rmdir, os.unlink, os.remove):
            func(target)
        elif target not in opened:  # it could not be opened or listed: now it can
            opened.add(target)
            shutil.rmtree(target, onerror=onerror)
        else:
            raise exc

    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    shutil.rmtree(path, onerror=onerror)
