"""Where the control socket is, by the CLI contract: `--socket`, else
$SESSIOND_SOCKET, else /run/sessiond/sessiond.sock as root, else
$XDG_RUNTIME_DIR/sessiond/sessiond.sock (/tmp/sessiond-UID/... without it).
Shared by the daemon and every client.

And whether a client may trust what is there (`socket_trust_problem`):
OpenSSH's StrictModes on the client's side, checked before a byte is sent,
so that a socket another user planted on the path (a squatted
/tmp/sessiond-UID, a world-writable directory) never receives a Hello or a
prompt.

The rule is written once, as text (`default_socket_text`): sessionctl's
one-shot path (supervisor.ctl.fast) must not import pathlib, which costs
more at start-up (~5-20 ms here) than that whole path's own work."""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["default_socket_path", "default_socket_text", "socket_trust_problem"]

# Below this, uids are system users (Debian's and Fedora's SYS_UID_MAX is
# 999): the daemon's own user when it runs as one (`sessiond`), never a
# person's login.  65534 (nobody) is one too.
_SYSTEM_UIDS_BELOW = 1000
_NOBODY = 65534


def default_socket_text() -> str:
    env = os.environ.get("SESSIOND_SOCKET")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/sessiond/sessiond.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/sessiond-{os.getuid()}"
    return f"{runtime}/sessiond/sessiond.sock"


def default_socket_path() -> Path:
    from pathlib import Path

    return Path(default_socket_text())


def socket_trust_problem(path: str) -> str:
    """Why a client must not talk to the socket at `path` ('' when it may).

    The socket and every directory above it (as written and after
    symlinks) must belong to root, to the invoking user, to a system user
    (a daemon run as `sessiond`), or to $SESSIOND_SOCKET_OWNER (a user name
    or uid: the user running the daemon, when it is someone else's own);
    and no directory may be writable by its group or others unless it is
    sticky (/tmp): whoever can write a directory can put their own socket
    in place of the daemon's.  A path that does not exist is left to
    connect() to report."""
    if "\0" in path:
        return ""  # connect() says what is wrong with it
    extra = _extra_owner()
    if extra is None:
        return f"$SESSIOND_SOCKET_OWNER names no user ({os.environ.get('SESSIOND_SOCKET_OWNER')!r})"
    real = os.path.realpath(path)
    dirs: list[str] = []
    for each in (os.path.abspath(path), real):
        parent = os.path.dirname(each)
        while True:
            if parent not in dirs:
                dirs.append(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
    for directory in sorted(dirs, key=len):
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"cannot check {directory}: {exc.strerror}"
        if not _trusted(st.st_uid, extra):
            return _not_trusted(directory, st.st_uid, extra)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others")) if st.st_mode & bit)
            return (f"{directory} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}) without the "
                    "sticky bit: anyone who can write it can put a socket of their own there")
    try:
        st = os.lstat(real)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot check {real}: {exc.strerror}"
    if not _trusted(st.st_uid, extra):
        return _not_trusted(real, st.st_uid, extra)
    return ""


def _extra_owner() -> int | None:
    """$SESSIOND_SOCKET_OWNER as a uid (-1 when unset), None if unknown."""
    name = os.environ.get("SESSIOND_SOCKET_OWNER", "")
    if not name:
        return -1
    if name.isdigit():
        return int(name)
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _trusted(uid: int, extra: int) -> bool:
    return uid in (0, os.geteuid(), extra, _NOBODY) or uid < _SYSTEM_UIDS_BELOW


def _not_trusted(where: str, uid: int, extra: int) -> str:
    import pwd

    try:
        name = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        name = f"uid {uid}"
    hint = ("" if extra == -1 else f" or $SESSIOND_SOCKET_OWNER (uid {extra})")
    return (f"{where} belongs to {name}, not to root, to you (uid {os.geteuid()}), to a system user"
            f"{hint}: another user may have put it there (set $SESSIOND_SOCKET_OWNER to that user if "
            "it really runs the daemon)")
