"""Who may use this daemon: one answer for the control socket and for every
re-check of a stored owner.

Runs in the daemon.  A client is admitted on the socket (`admits`, from the
peer's credentials) and a session read back from a store is checked again
(`may_own`, from the owner uid it names: at load, import, claim, repair);
both ask the same `Admission`, built once at start from the config and the
group of the listening socket.  The socket's group is read from the socket
itself, as systemd's socket-activated services take it: under the shipped
unit, `SocketGroup=` of sessiond.socket (the config's `socket_group` may
then be empty, and install.sh's default config leaves it so); when the
daemon binds the socket, the group it gave it.  A config whose
`socket_group` names another group than the socket systemd handed over is
refused at start (supervisor.host.users.listening_group), naming both: never a silent
`damaged` for the sessions of every ordinary user after a restart.

    admitted: root, the daemon's own uid, [daemon] admin_uids and
    allowed_uids, members of allowed_gids or of the socket's group (unless
    that is group 0); never a uid that only sessions run as (may_own).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import NamedTuple

from supervisor.config import Config
from supervisor.host.users import login_groups

__all__ = ["Admission", "Identities", "SessionUids"]


class Identities(NamedTuple):
    """Who workers run as: `run_as` for all of them ([daemon] worker_user),
    else a uid per session from `session_uids`, else as the daemon; and
    the group of the listening socket (None where there is none: tests of
    the core alone)."""

    run_as: tuple[int, int] | None = None
    session_uids: range | None = None
    socket_gid: int | None = None


class SessionUids(NamedTuple):
    """The uids a session's processes can run as here; for
    supervisor.api.peer, which tells a session's process by them, and for
    `Admission.may_own` (a session's own uid owns no session)."""

    daemon: int  # the daemon's own: the zygote's, and the sessions' when nothing else is set
    worker: int | None  # [daemon] worker_user
    span: range | None  # [daemon] session_uid_range, when each session gets a uid of its own

    def only_sessions(self, uid: int) -> bool:
        """A uid that no client of ours has: every process of it is a session's."""
        if uid == self.daemon:
            return False
        return uid == self.worker or (self.span is not None and uid in self.span)

    def could_be_session(self, uid: int) -> bool:
        return uid == self.daemon or self.only_sessions(uid)


class Admission:
    """The one policy: `admits` for a connecting peer, `may_own` for a
    stored owner.  The config is read at each call (a reload may change
    allowed_uids and the rest); the socket's group is fixed at start."""

    def __init__(self, config: Callable[[], Config], identities: Identities) -> None:
        self._config = config
        self.identities = identities
        self.own_uid = os.geteuid()

    def session_uids(self) -> SessionUids:
        run_as, span = self.identities.run_as, self.identities.session_uids
        worker = run_as[0] if run_as is not None else None
        return SessionUids(self.own_uid, worker, span if run_as is None else None)

    def is_admin(self, uid: int) -> bool:
        """Root and [daemon] admin_uids.  Not the daemon's own uid: under the
        unit that is also the uid a session's tools run as."""
        return uid == 0 or uid in self._config().daemon.admin_uids

    def groups(self) -> set[int]:
        """The groups whose members are admitted."""
        groups = set(self._config().daemon.allowed_gids)
        gid = self.identities.socket_gid
        if gid is not None and gid != 0:  # root's group opens no door
            groups.add(gid)
        return groups

    def admits(self, uid: int, gid: int, groups: Iterable[int]) -> bool:
        """A peer with these credentials (SO_PEERCRED, SO_PEERGROUPS): whoever
        the operator let through the socket's mode may talk."""
        cfg = self._config().daemon
        if uid == self.own_uid or self.is_admin(uid) or uid in cfg.allowed_uids:
            return True
        return not self.groups().isdisjoint({gid, *groups})

    def may_own(self, uid: int) -> bool:
        """Whether a stored owner uid may own sessions here: one `admits`
        would admit, by its passwd entry's groups (as login gives them),
        that is not a uid only sessions run as."""
        if self.session_uids().only_sessions(uid):
            return False
        cfg = self._config().daemon
        if uid == self.own_uid or self.is_admin(uid) or uid in cfg.allowed_uids:
            return True
        found = login_groups(uid)
        if found is None:
            return False
        return self.admits(uid, found[0], found[1])
