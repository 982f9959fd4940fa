"""Who a session's worker runs as, and its workspace on disk.

Runs in the daemon.  A session's worker runs as one user for all
(`[daemon] worker_user`), as a uid of its own from `session_uid_range` (a
root daemon's default; kept in the session's meta for its life), or as the
daemon.  Its workspace is `<root>/ID@TOKEN`: a new TOKEN for every session,
so a later session that reuses an id never sees an old workspace; created
and chowned only by the daemon, never through a link; removed with the
session.
"""

from __future__ import annotations

import contextlib
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
from supervisor.errors import Capacity
from supervisor.logtag import tagged
from supervisor.peer import SessionUids
from supervisor.session import Session

__all__ = ["Workspaces"]

log = logging.getLogger("sessiond.manager")


class Workspaces:
    def __init__(
        self,
        config: Callable[[], Config],
        state_dir: Path,
        run_as: tuple[int, int] | None,
        session_uids: range | None,
    ) -> None:
        self._config = config
        self._state_dir = state_dir
        self.shared_user = run_as
        self.session_uids = session_uids if run_as is None else None

    @property
    def separate_users(self) -> bool:
        """Whether workers run as a user other than the daemon's."""
        return self.shared_user is not None or self.session_uids is not None

    def session_uids_here(self) -> SessionUids:
        """Which uids sessions run as, for supervisor.peer."""
        worker = self.shared_user[0] if self.shared_user is not None else None
        return SessionUids(os.geteuid(), worker, self.session_uids)

    def root(self) -> Path:
        return workspace_root(self._config(), self._state_dir)

    def path(self, session: Session) -> Path:
        return self.root() / (session.meta.workspace or session.id)

    def run_as(self, session: Session) -> tuple[int, int] | None:
        if self.shared_user is not None:
            return self.shared_user
        uid = session.meta.run_uid
        return (uid, uid) if uid is not None else None

    def allocate_uid(self, sessions: Iterable[Session]) -> int | None:
        """A uid of session_uid_range that no session holds and no user owns.
        Picked at random, so that a uid just freed is unlikely to be handed
        out again soon (what its last session left in /tmp stays its own)."""
        span = self.session_uids
        if span is None:
            return None
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
        runs as).  Only a directory the daemon itself named and created is
        chowned: never one that was already there, never through a link."""
        workspace = self.path(session)
        run_as = self.run_as(session)
        try:
            workspace.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(workspace, 0o700)
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
        except OSError as exc:
            tagged(log, session.id).warning("cannot prepare workspace %s: %s", workspace, exc)
        return workspace

    def remove(self, session: Session) -> None:
        """Blocking: call from a thread, a workspace can be large."""
        _rmtree(self.path(session))

    def remove_orphans(self, sessions: Iterable[Session]) -> None:
        """Workspaces ("ID@TOKEN") whose session is gone: the daemon died
        between removing a session and removing its workspace."""
        root = self.root()
        sessions = list(sessions)
        wanted = {s.meta.workspace for s in sessions}
        # A damaged session whose metadata is unreadable keeps whatever may be its own.
        lost = tuple(f"{s.id}@" for s in sessions if s.meta_lost)
        try:
            entries = list(os.scandir(root))
        except OSError:
            return
        for entry in entries:
            if (
                "@" in entry.name and entry.name not in wanted and not entry.name.startswith(lost)
                and entry.is_dir(follow_symlinks=False)
            ):
                log.info("removing the workspace of a deleted session: %s", entry.path)
                _rmtree(Path(entry.path))


def _no_such_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def _rmtree(path: Path) -> None:
    """Remove a tree that a session's tools may have made hard to remove
    (directories without write or search permission); never follows links."""

    def onerror(func: Any, target: str, exc_info: Any) -> None:
        exc = exc_info[1]
        if isinstance(exc, FileNotFoundError):
            return
        if not isinstance(exc, PermissionError):
            raise exc
        for directory in (os.path.dirname(target), target):
            if os.path.isdir(directory) and not os.path.islink(directory):
                with contextlib.suppress(OSError):
                    os.chmod(directory, 0o700)
        if func in (os.rmdir, os.unlink, os.remove):
            func(target)
        else:  # it could not be opened or listed: now it can
            shutil.rmtree(target, onerror=onerror)

    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    shutil.rmtree(path, onerror=onerror)
