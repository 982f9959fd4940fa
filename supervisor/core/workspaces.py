"""Who a session's worker runs as, and its workspace on disk.

Runs in the daemon.  A session's worker runs as one user for all
(`[daemon] worker_user`), as a uid of its own from `session_uid_range` (a
root daemon's default; kept in the session's meta for its life), or as the
daemon.  Its workspace is `<root>/ID@TOKEN`: a new TOKEN for every session,
so a later session that reuses an id never sees an old workspace; created
and chowned only by the daemon, never through a link; removed with the
session.  This module decides (whose, where, which are orphans);
supervisor.host.workspaces does the disk's part.

What a store gives back is data (`stored_problem`): a session's owner,
workspace name, uid and handler are checked again whenever one is
materialised from stored data (start, import, repair, a claim), as they
were on create, and `path` only ever names one directory right beneath
the root.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Container, Iterable
from pathlib import Path

from supervisor.config import Config, workspace_root
from supervisor.core.admission import Admission, SessionUids
from supervisor.errors import Capacity, SessiondError
from supervisor.host.diskquota import QuotaPath, detect
from supervisor.host.users import user_exists
from supervisor.host.workspaces import WorkspaceDisk, dir_owner, open_dirs, owns_an_entry
from supervisor.logtag import tagged
from supervisor.core.overrides import check_handler
from supervisor.core.session import Session, valid_session_id
from supervisor.spawn import diskimage, sysvipc
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
        # What makes, caps, mounts and removes them (supervisor.host.workspaces).
        self.disk = WorkspaceDisk(self.quota, self.root)
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
            owner = dir_owner(where)
        except FileNotFoundError:
            # Not made yet (an import; a create cut short): then no other
            # workspace may be that uid's either.
            if owns_an_entry(self.root(), uid):
                return f"its stored uid {uid} owns another session's workspace", False
            return None
        except OSError as exc:
            return f"its workspace {where} cannot be checked ({exc.strerror}); `rm` it", True
        if owner != uid:
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

    def allocate_uid(self, taken: Container[int | None]) -> int | None:
        """A uid of session_uid_range that no session holds (`taken`: the
        registry's run uids) and no user owns.  Picked at random, so that a
        uid just freed is unlikely to be handed out again soon (what its
        last session left in /tmp stays its own)."""
        span = self.session_uids
        if span is None:
            return None
        # The last uid is kept for listing MCP servers' tools (supervisor.spawn.mcplist).
        span = span[:-1] if len(span) > 1 else span
        for _ in range(64):
            uid = span[secrets.randbelow(len(span))]
            if uid not in taken and not user_exists(uid):
                return uid
        free = [u for u in span if u not in taken and not user_exists(u)]
        if not free:
            raise Capacity(f"every uid of [daemon] session_uid_range ({span.start}-{span.stop - 1}) is in use")
        return free[secrets.randbelow(len(free))]

    def prepare(self, session: Session) -> Path:
        """The session's workspace made, or its image mounted again
        (supervisor.host.workspaces).  Blocking: the workers call it in a
        thread.  Raises Capacity or Internal where its image cannot be had:
        a session never runs in an uncapped workspace the operator was told
        is capped."""
        return self.disk.prepare(session.id, self.path(session), self.run_as(session),
                                 session.settings.agent.limits)

    def remove(self, session: Session) -> None:
        """Blocking: call from a thread, a workspace can be large.  What its
        uid left in IPC goes too (a daemon killed since its worker ended)."""
        self.ended(session, here=True)
        self.disk.remove(self.path(session))

    def close(self) -> None:
        """At the daemon's stop, once its workers are gone: every workspace
        image unmounted, so that a daemon outside systemd leaves no mount
        behind (the next start mounts each again at its session's start)."""
        self.disk.close()

    def open_dirs(self, sessions_dir: Path) -> None:
        """At start: the sessions' directory; where workers run as another
        user, their way to their workspace."""
        open_dirs(sessions_dir, self._state_dir, self.root() if self.separate_users else None)

    def remove_orphans(self, sessions: Iterable[Session]) -> None:
        """Workspaces ("ID@TOKEN") and their images whose session is gone:
        the daemon died between removing a session and removing its
        workspace; and loop devices a killed daemon left attached."""
        root = self.root()
        sessions = list(sessions)
        wanted = {s.meta.workspace for s in sessions}
        # A damaged session whose metadata is unreadable keeps whatever may be its own.
        lost = tuple(f"{s.id}@" for s in sessions if s.meta_lost)
        names = self.disk.names()
        if names is None:
            return
        for name in sorted(names):
            if name not in wanted and not name.startswith(lost):
                log.info("removing the workspace of a deleted session: %s", root / name)
                self.disk.remove(root / name)
        self.disk.release_stale()


def _own_workspace(session_id: str, name: str) -> bool:
    """Whether `name` is one create gives `session_id`'s workspace: ID@ and
    16 lowercase hex digits (secrets.token_hex(8))."""
    token = name[len(session_id) + 1 :]
    return (name.startswith(f"{session_id}@") and len(token) == 16
            and all(c in "0123456789abcdef" for c in token))


