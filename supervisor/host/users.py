"""Who is who on this host: passwd and group lookups, and the group of
the listening socket.

Runs in the daemon: at start (`resolve_group`, `listening_group`, from the
start-up checks) and on the loop when a stored owner is checked again or a
session uid is handed out (`login_groups`, `user_exists`: the name service,
/etc/passwd or whatever NSS asks).  The policy that uses them is
supervisor.core.admission.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket

from supervisor.errors import StartupError

__all__ = ["listening_group", "login_groups", "resolve_group", "user_exists"]


def user_exists(uid: int) -> bool:
    """Whether the passwd database names `uid`."""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def login_groups(uid: int) -> tuple[int, list[int]] | None:
    """`uid`'s primary group and every group login gives it, by its passwd
    entry (None: no such user, or its groups cannot be read)."""
    try:
        entry = pwd.getpwuid(uid)
        return entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)
    except (KeyError, OSError):
        return None


def resolve_group(name: str) -> int:
    """[daemon] socket_group as a gid (a name or a number)."""
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError as exc:
        raise StartupError(f"[daemon] socket_group: no such group {name!r}") from exc


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name!r} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def listening_group(sock: socket.socket, configured: str) -> int | None:
    """The group of the listening socket, the group its clients were let in
    by: systemd's (SocketGroup=, handed over in LISTEN_FDS), or the one
    `bind_socket` gave it.  A config that names another group than a
    handed-over socket has is an error naming both: admission would
    otherwise differ between the socket's mode and the daemon's checks."""
    try:
        where = sock.getsockname()
        gid = os.stat(where).st_gid if isinstance(where, str) and where.startswith("/") else None
    except OSError:
        gid = None
    if not configured:
        return gid
    wanted = resolve_group(configured)
    if gid is None:
        return wanted
    if gid != wanted:
        raise StartupError(
            f"[daemon] socket_group = {configured!r} is {_group_name(wanted)}, but the socket systemd "
            f"handed over ({where}) belongs to group {_group_name(gid)} (sessiond.socket's "
            "SocketGroup=): set both alike, or leave socket_group empty to admit the socket's group"
        )
    return gid
