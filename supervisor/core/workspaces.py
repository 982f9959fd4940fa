"""Who a session's worker runs as, and its workspace on disk.

Runs in the daemon.  A session's worker runs as one user for all
(`[daemon] worker_user`), as a uid of its own from `session_uid_range` (a
root daemon's default; kept in the session's meta for its life), or as the
daemon.  Its workspace is `<root>/ID@TOKEN`: a new TOKEN for every session,
so a later session that reuses an id never sees an old workspace; created
and chowned only by the daemon, never through a link; removed with the
session.

What a store gives back is data (`stored_problem`): a session's owner,
workspace name, uid and handler are checked again whenever one is
materialised from stored data (start, import, repair, a claim), as they
were on create, and `path` only ever names one directory right beneath
the root.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from supervisor.config import Config, workspace_root
from supervisor.core.admission import Admission, SessionUids
from supervisor.core import btrfs
from supervisor.core.diskquota import IMAGES, QuotaPath, detect
from supervisor.errors import Capacity, Internal, NoLoopDevice, SessiondError
from supervisor.logtag import tagged
from supervisor.core.overrides import check_handler
from supervisor.core.session import Session, valid_session_id
from supervisor.spawn import diskimage, sysvipc
from supervisor.spawn.ceilings import fork_refusal
from supervisor.store.state_store import Meta
from supervisor.core.states import State

__all__ = ["SessionUids", "Workspaces"]  # SessionUids: supervisor.core.admission's

log = logging.getLogger("sessiond.manager")


class Workspaces:
    def __init__(self, config: Callable[[], Config], state_dir: Path, admission: Admission) -> None:
        self._config = config
        self._state_dir = state_dir
        # Who may own sessions: the control socket's own policy (supervisor.core.admission).
        self.admission = admission
        run_as, session_uids = admission.identities.run_as, admission.identities.session_uids
        self.shared_user = run_as
        self.session_uids = session_uids if run_as is None else None
        # How max_disk_mb is enforced under the workspace root, found once.
        self.quota: QuotaPath = detect(self.root(), config().tools.disk_quota)
        # Where sessions' SysV IPC lives, and what becomes of it.
        self.ipc, shared = self._ipc_scope()
        log.log(logging.WARNING if shared else logging.INFO, "IPC of sessions: %s", self.ipc)

    @property
    def separate_users(self) -> bool:
        """Whether workers run as a user other than the daemon's."""
        return self.shared_user is not None or self.session_uids is not None

    def session_uids_here(self) -> SessionUids:
        """Which uids sessions run as, for supervisor.api.peer."""
        return self.admission.session_uids()

    def _ipc_scope(self) -> tuple[str, bool]:
        """What `stats` says of sessions' SysV IPC, and whether it can
        outlive them (the operator is warned at start)."""
        if os.geteuid() == 0 and diskimage.capability():
            return "a namespace per session: its worker makes one before it drops to its uid", False
        own = self.session_uids is not None
        if own:
            return ("the host's namespace (no CAP_SYS_ADMIN for one of their own, where bubblewrap does "
                    "not make it): what a session's uid leaves is removed when its worker ends"), False
        why = sysvipc.userns_ipc()
        if not why:
            return ("a namespace per session's tools: bubblewrap's, or the tool host's own in a user "
                    "namespace; handler code shares the daemon's"), False
        return (f"the host's namespace where bubblewrap does not make one ({why}), and sessions share a uid: "
                "SysV IPC a session's tools make there outlives the session (run the daemon as root, or "
                "with namespaces)"), True

    def host_report(self) -> dict[str, str]:
        """The workspaces' part of `stats`: how the disk caps hold, where IPC lives."""
        return {"disk_quota": self.quota.describe(), "ipc": self.ipc}

    def ended(self, session: Session, here: bool) -> None:
        """Its worker ended (on the loop, after its processes were killed):
        what its own uid left in the host's IPC namespace goes.  Not a
        shared uid's (whose objects no session can be told from), nor for
        a worker on another machine (`here` False)."""
        uid = session.meta.run_uid
        if here and uid is not None and self.session_uids is not None and os.geteuid() == 0:
            problem = sysvipc.remove(uid)
            if problem:
                tagged(log, session.id).warning("what its uid left in the IPC namespace stays: %s", problem)

    def stored_problem(self, meta: Meta, others: Iterable[Session]) -> tuple[str, bool] | None:
        """Why a session read back from a store must not be acted on, and
        whether the rest of what it says may still be believed (False:
        its owner and workspace are not); None when it passes.  Checked as
        on create: whoever reached the store could have written anything
        (an owner of their choosing, a workspace of `..`, a handler)."""
        if not valid_session_id(meta.id):
            return f"its stored id {meta.id!r} is not a session id", False
        if meta.workspace and not _own_workspace(meta.id, meta.workspace):
            return f"its stored workspace {meta.workspace!r} is not one of its own ({meta.id}@TOKEN)", False
        if meta.parent is not None and not valid_session_id(meta.parent):
            return f"its stored parent {meta.parent!r} is not a session id", False
        if not self.admission.may_own(meta.owner_uid):
            return (f"its stored owner uid {meta.owner_uid} may not own sessions here (neither root, the "
                    "daemon's user, admin_uids, allowed_uids nor a member of allowed_gids or the "
                    "socket's group; or a session's own uid)"), False
        if (problem := self._uid_problem(meta, others)) is not None:
            return problem
        settings = self._config().session_settings()
        if meta.handler not in ("agent", "echo", *settings.agent.subagents.allowed_handlers):
            try:
                check_handler(meta.handler, settings)
            except SessiondError as exc:
                return f"its stored handler is not allowed: {exc.message}", True
        return None

    def _uid_problem(self, meta: Meta, others: Iterable[Session]) -> tuple[str, bool] | None:
        """Where each session runs as a uid of its own: the stored one is of
        the range, no other session's, and the one its workspace was made
        for (a uid rewritten to another session's does not match it)."""
        if self.shared_user is not None or self.session_uids is None:
            return None  # not used (run_as)
        span, uid = self.session_uids, meta.run_uid
        if uid is None or uid not in span:
            return f"its stored uid {uid} is not one of [daemon] session_uid_range ({span.start}-{span.stop - 1})", False
        if any(s.meta.run_uid == uid and s.id != meta.id and not s.is_(State.DAMAGED) for s in others):
            return f"its stored uid {uid} is another session's", False
        where = self.root() / (meta.workspace or meta.id)
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            # Not made yet (an import; a create cut short): then no other
            # workspace may be that uid's either.
            if _owns_a_workspace(self.root(), uid):
                return f"its stored uid {uid} owns another session's workspace", False
            return None
        except OSError as exc:
            return f"its workspace {where} cannot be checked ({exc.strerror}); `rm` it", True
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            return f"its workspace {where} is not a directory of its stored uid {uid}", False
        return None

    def root(self) -> Path:
        return workspace_root(self._config(), self._state_dir)

    def path(self, session: Session) -> Path:
        """One directory right beneath the root, whatever the meta says:
        a stored name was checked on load (stored_problem), and should one
        ever get past that, a name of the daemon's own making stands in."""
        name = session.meta.workspace or session.id
        if not (_own_workspace(session.id, name) or name == session.id) or not valid_session_id(session.id):
            name = f"{session.id}@{'0' * 16}"
            tagged(log, session.id).error("its stored workspace %r is not its own; using %s instead",
                                          session.meta.workspace, name)
        return self.root() / name

    def run_as(self, session: Session) -> tuple[int, int] | None:
        if self.shared_user is not None:
            return self.shared_user
        if self.session_uids is None:
            return None  # a stored run_uid says nothing once sessions get no uid of their own
        uid = session.meta.run_uid
        return (uid, uid) if uid is not None else None

    def allocate_uid(self, sessions: Iterable[Session]) -> int | None:
        """A uid of session_uid_range that no session holds and no user owns.
        Picked at random, so that a uid just freed is unlikely to be handed
        out again soon (what its last session left in /tmp stays its own)."""
        span = self.session_uids
        if span is None:
            return None
        # The last uid is kept for listing MCP servers' tools (supervisor.spawn.mcplist).
        span = span[:-1] if len(span) > 1 else span
        taken = {s.meta.run_uid for s in sessions}
        for _ in range(64):
            uid = span[secrets.randbelow(len(span))]
            if uid not in taken and _no_such_user(uid):
                return uid
        free = [u for u in span if u not in taken and _no_such_user(u)]
        if not free:
            raise Capacity(f"every uid of [daemon] session_uid_range ({span.start}-{span.stop - 1}) is in use")
        return free[secrets.randbelow(len(free))]

    def prepare(self, session: Session) -> Path:
        """Create the session's workspace (0700, owned by whoever its worker
        runs as), or mount its image again.  Only a directory the daemon
        itself named and created is chowned: never one that was already
        there, never through a link.  Blocking (an image is made by a
        process): the workers call it in a thread.  Raises Capacity (no
        loop device) or Internal where its image cannot be made or mounted:
        a session never runs in an uncapped workspace the operator was told
        is capped."""
        workspace = self.path(session)
        run_as = self.run_as(session)
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
                self._cap(session, workspace)
        except OSError as exc:
            tagged(log, session.id).warning("cannot prepare workspace %s: %s", workspace, exc)
            return workspace
        if self.quota.images:
            self._mount(session, workspace, run_as, made)
        return workspace

    def _make(self, workspace: Path) -> None:
        if not self.quota.kernel or self.quota.images:
            os.mkdir(workspace, 0o700)
            return
        btrfs.make_workspace(str(workspace.parent), workspace.name)
        os.chmod(workspace, 0o700)  # made as the umask says; nobody has used it yet

    def _cap(self, session: Session, workspace: Path) -> None:
        """The kernel's cap at the session's max_disk_mb, set again at every
        start (a restart after a config change takes the new figure)."""
        cap = session.settings.agent.limits.max_disk_mb
        try:
            btrfs.set_limit(str(workspace), None if cap is None else cap << 20)
        except OSError as exc:
            # A workspace made before quotas were on is a plain directory:
            # the walk alone holds it (supervisor.core.diskquota).
            tagged(log, session.id).warning(
                "workspace %s: the kernel's disk cap could not be set (%s); max_disk_mb is measured "
                "for this session instead (a workspace made before btrfs quotas were on is not a "
                "subvolume)", workspace, exc.strerror or exc)

    def _image(self, name: str) -> str:
        return str(self.root() / IMAGES / f"{name}.img")

    def _mount(self, session: Session, workspace: Path, run_as: tuple[int, int] | None, made: bool) -> None:
        """The workspace as an image of its own: made at its first start
        (sized from the session's max_disk_mb and max_disk_inodes then),
        mounted again at a start after the daemon's (a restart of the
        shipped unit took its mount namespace, and the mount, with it)."""
        limits = session.settings.agent.limits
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
                tagged(log, session.id).warning(
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
            tagged(log, session.id).error("workspace %s: its disk image could not be made or mounted: %s",
                                          workspace, exc)
            raise Internal(f"its workspace's disk image could not be made or mounted: {exc.strerror or exc}") \
                from exc

    def remove(self, session: Session) -> None:
        """Blocking: call from a thread, a workspace can be large.  What its
        uid left in IPC goes too (a daemon killed since its worker ended)."""
        self.ended(session, here=True)
        self._remove(self.path(session))

    def _remove(self, path: Path) -> None:
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
            _rmtree(path)

    def close(self) -> None:
        """At the daemon's stop, once its workers are gone: unmount every
        workspace image, so that a daemon outside systemd leaves no mount
        behind (the next start mounts each again at its session's start)."""
        if not self.quota.images:
            return
        images = self.root() / IMAGES
        with contextlib.suppress(OSError):
            for entry in os.scandir(images):
                if entry.name.endswith(".img"):
                    with contextlib.suppress(OSError):
                        diskimage.unmount(str(self.root() / entry.name[:-4]), (entry.path,))

    def remove_orphans(self, sessions: Iterable[Session]) -> None:
        """Workspaces ("ID@TOKEN") and their images whose session is gone:
        the daemon died between removing a session and removing its
        workspace; and loop devices a killed daemon left attached."""
        root = self.root()
        sessions = list(sessions)
        wanted = {s.meta.workspace for s in sessions}
        # A damaged session whose metadata is unreadable keeps whatever may be its own.
        lost = tuple(f"{s.id}@" for s in sessions if s.meta_lost)
        names: set[str] = set()
        with contextlib.suppress(OSError):
            for entry in os.scandir(root / IMAGES):
                name = entry.name.removesuffix(".new").removesuffix(".img")
                if "@" in name and not entry.name.startswith(".probe-"):
                    names.add(name)
        try:
            entries = list(os.scandir(root))
        except OSError:
            return
        names |= {e.name for e in entries if "@" in e.name and e.is_dir(follow_symlinks=False)}
        for name in sorted(names):
            if name not in wanted and not name.startswith(lost):
                log.info("removing the workspace of a deleted session: %s", root / name)
                self._remove(root / name)
        if self.quota.images:
            for loop in diskimage.release_stale(str(root / IMAGES)):
                log.warning("detached loop device %s: it held a workspace image that nothing mounted "
                            "(a daemon killed while mounting it)", loop)


def _own_workspace(session_id: str, name: str) -> bool:
    """Whether `name` is one create gives `session_id`'s workspace: ID@ and
    16 lowercase hex digits (secrets.token_hex(8))."""
    token = name[len(session_id) + 1 :]
    return (name.startswith(f"{session_id}@") and len(token) == 16
            and all(c in "0123456789abcdef" for c in token))


def _owns_a_workspace(root: Path, uid: int) -> bool:
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


def _no_such_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def _rmtree(path: Path) -> None:
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
