"""The daemon's start-up checks, each a clear refusal (StartupError: one
line and an exit code, never a traceback later), run before the zygote is
forked, while this process has no thread and no event loop
(supervisor.daemon.run_daemon calls `check`, then binds the sockets).

Runs in the daemon, at start only.  By job:

- the state directory: no one but root and us can replace anything on its
  path (as OpenSSH's StrictModes), created, locked for this daemon alone;
- the control socket: no live daemon replaced, nobody able to swap it;
  bound with its mode and group, or systemd's taken over; the metrics
  listener;
- who runs what: workers' uid (worker_user, or a uid per session, never
  root's tools unless said), and their way to their workspaces;
- the host: a cgroup per session or why not, what confines tools here (the
  sandbox probe), the store's driver.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import pwd
import socket
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

from ipc import messages as m
from ipc.install import install_command
from supervisor.config import Config, metrics_address, uid_range, workspace_root
from supervisor.core.admission import Identities
from supervisor.errors import StartupError
from supervisor.host.users import resolve_group
from supervisor.ops import metrics, sdnotify
from supervisor.spawn import sandbox
from supervisor.spawn.cgroups import Cgroups
from supervisor.spawn.cgroups_detect import detect as cgroup_detect

__all__ = [
    "LOCK_FILE", "Found", "bind_metrics", "bind_socket", "check", "check_ancestors", "check_state_dir",
    "check_store_driver", "check_workspaces_reachable", "detect_cgroups", "inherited_socket", "lock_state_dir",
    "prepare_socket_path", "probe_sandbox", "resolve_identities", "resolve_worker_user",
]

log = logging.getLogger("sessiond")


class Found(NamedTuple):
    """What the checks found, for the daemon to build with."""

    lock_fd: int  # the state directory's lock: keep it open for the process's life
    inherited: socket.socket | None  # systemd's listening socket, if it handed one over
    identities: Identities  # who workers run as (the socket's group is added once it listens)
    cgroups: tuple[Cgroups | None, str]  # a cgroup per session, or why not
    sandbox: m.SandboxBoot  # what confines tools here


def check(cfg: Config, state_dir: Path, socket_path: Path, config_path: Path | None) -> Found:
    """Every check before the zygote is forked, in order; a StartupError
    names what is wrong.  Nothing here starts a thread."""
    lock_fd = check_state_dir(state_dir)
    if cfg.daemon.socket_group:
        resolve_group(cfg.daemon.socket_group)
    inherited = inherited_socket()
    if inherited is None:
        prepare_socket_path(socket_path)
    identities = resolve_identities(cfg)
    if identities.run_as is not None or identities.session_uids is not None:
        os.chmod(state_dir, 0o711)  # workers pass through to their workspace; never list it
    check_workspaces_reachable(workspace_root(cfg, state_dir), identities)
    clustered = cfg.cluster.backend == "ray"
    # Before the zygote: it is forked into the daemon's leaf.  In cluster
    # mode the workers are on other machines: no cgroup here is theirs.
    # Before the sandbox probe too: bwrap's children may linger a moment
    # after it returns, and would make our cgroup look shared.
    cgroups = detect_cgroups(cfg) if not clustered else (None, "cluster mode: workers run on Ray node hosts")
    # What the kernel counts for sessions besides what the daemon reads in
    # /proc (cluster mode: the workers' nodes measure them).
    counted = {"memory", "pids"} if clustered else cgroups[0].controllers if cgroups[0] is not None else set()
    sandbox_boot = probe_sandbox(cfg, identities, state_dir, socket_path, config_path, counted)
    check_store_driver(cfg)
    return Found(lock_fd, inherited, identities, cgroups, sandbox_boot)


# ---------------------------------------------------------------- the state directory


def check_ancestors(path: Path, what: str) -> None:
    """Refuse `path` unless no one but root and us can replace it.

    As OpenSSH's StrictModes: every directory from / down to `path` itself
    (after symlinks) must belong to root or to our euid, and must not be
    writable by group or others unless it has the sticky bit (/tmp), since
    whoever can write a directory can rename what is in it and put their
    own in its place: a socket clients trust, or state we load.  Components
    that do not exist yet are ours to create (0700/0755) and are checked by
    calling this again once they exist."""
    euid = os.geteuid()
    real = Path(os.path.realpath(path))
    for directory in [*reversed(real.parents), real]:
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StartupError(f"{what} {path}: cannot check {directory}: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            return  # not a directory: the caller's own checks say so
        if st.st_uid not in (0, euid):
            raise StartupError(
                f"{what} {path}: {directory} belongs to uid {st.st_uid} ({_user_name(st.st_uid)}), "
                f"not to root or to this user (uid {euid}); its owner could replace anything "
                "below it. Fix its ownership or choose another path"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others")) if st.st_mode & bit)
            raise StartupError(
                f"{what} {path}: {directory} is writable by {who} "
                f"(mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}) without the sticky "
                "bit, so they could replace anything below it. Remove that write permission "
                "(chmod go-w) or choose another path"
            )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


LOCK_FILE = "sessiond.lock"


def lock_state_dir(path: Path) -> int:
    """Take the state directory for this daemon alone: an exclusive flock
    on `sessiond.lock`, held (by the returned fd) for the process's life,
    with our pid written in it for whoever is refused.  The kernel drops the
    lock when we die, however we die, so a stale one cannot block a restart.
    Two daemons on one state dir would both append to the same logs."""
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StartupError(f"cannot open the lock file {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"state directory {path} is in use by another sessiond (pid {holder}, which holds "
            f"{lock_path}); stop that daemon first, or give this one its own --state-dir"
        ) from exc
    except OSError as exc:
        os.close(fd)
        raise StartupError(f"cannot lock {lock_path}: {exc.strerror}") from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise StartupError(f"state directory {path} is not usable: cannot write {lock_path}: "
                           f"{exc.strerror}") from exc
    return fd


def check_state_dir(path: Path) -> int:
    """Check, create and lock the state directory; returns the lock's fd
    (keep it open).  Nothing below it is written before the lock is held."""
    check_ancestors(path, "state directory")
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StartupError(
            f"state directory {path} is not usable: {exc.strerror or exc}"
            " (set [daemon] state_dir or --state-dir to a writable directory)"
        ) from exc
    lock_fd = lock_state_dir(path)
    try:
        _prepare_state_dir(path)
    except BaseException:
        os.close(lock_fd)
        raise
    return lock_fd


def _prepare_state_dir(path: Path) -> None:
    try:
        (path / "sessions").mkdir(exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=path / "sessions", prefix=".probe-") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise StartupError(
            f"state directory {path} is not usable: {exc.strerror or exc}"
            " (set [daemon] state_dir or --state-dir to a writable directory)"
        ) from exc
    check_ancestors(path, "state directory")  # now with what we created


# ---------------------------------------------------------------- the sockets


def _socket_in_use(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def prepare_socket_path(path: Path) -> None:
    """Refuse to start over a live daemon, or where someone else could swap
    our socket (e.g. they made /tmp/sessiond-UID first); clear a stale
    socket file."""
    check_ancestors(path.parent, "socket directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    except OSError as exc:
        raise StartupError(f"cannot create the socket directory {path.parent}: {exc.strerror}") from exc
    check_ancestors(path.parent, "socket directory")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        if _socket_in_use(path):
            raise StartupError(f"another sessiond is already listening on {path}")
        path.unlink()
    if len(os.fsencode(str(path))) >= 108:
        raise StartupError(f"socket path {path} is too long for a Unix socket (max 107 bytes)")


def bind_socket(path: Path, mode: int, group: str = "") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from exc
    finally:
        os.umask(old_umask)
    if group:
        os.chown(path, -1, resolve_group(group))
    os.chmod(path, mode)
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def inherited_socket() -> socket.socket | None:
    """A listening socket passed by systemd socket activation, if any."""
    socks = sdnotify.listen_fds()
    for extra in socks[1:]:
        extra.close()
    if socks:
        socks[0].setblocking(False)
        return socks[0]
    return None


def bind_metrics(cfg: Config) -> socket.socket | None:
    """The listener for `[daemon] metrics_listen`, or None when it is off."""
    where = metrics_address(cfg.daemon.metrics_listen)
    if where is None:
        return None
    if isinstance(where, str):
        prepare_socket_path(Path(where))  # as the control socket: no live one replaced
    try:
        return metrics.bind_listener(where)
    except OSError as exc:
        raise StartupError(
            f"[daemon] metrics_listen = {cfg.daemon.metrics_listen!r}: cannot listen there: "
            f"{exc.strerror or exc}"
        ) from exc


# ---------------------------------------------------------------- who runs what


def resolve_identities(cfg: Config) -> Identities:
    """As root, tools never run as root unless the operator says so
    (allow_root_tools), as sshd's and postfix's privilege separation refuse."""
    if cfg.daemon.worker_user:
        return Identities(resolve_worker_user(cfg), None)
    if os.geteuid() != 0:
        return Identities(None, None)
    if cfg.daemon.allow_root_tools:
        log.warning("workers and their tools run as root ([daemon] allow_root_tools = true)")
        return Identities(None, None)
    uids = uid_range(cfg.daemon.session_uid_range)
    if uids is None:
        raise StartupError(
            "running as root with no [daemon] worker_user and an empty [daemon] session_uid_range: "
            "every session's tools would run as root; set worker_user, or a session_uid_range "
            "(a uid per session), or allow_root_tools = true if tools running as root is really meant"
        )
    log.info("each session runs as its own uid from %d-%d ([daemon] session_uid_range)",
             uids.start, uids.stop - 1)
    return Identities(None, uids)


def resolve_worker_user(cfg: Config) -> tuple[int, int] | None:
    """[daemon] worker_user as (uid, gid), or None to run workers as we run."""
    name = cfg.daemon.worker_user
    if not name:
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError) as exc:
        raise StartupError(f"[daemon] worker_user: no such user {name!r}") from exc
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise StartupError(
            f"[daemon] worker_user = {name!r} needs the daemon to run as root "
            f"(it runs as uid {os.geteuid()})"
        )
    return entry.pw_uid, entry.pw_gid


def check_workspaces_reachable(root: Path, identities: Identities) -> None:
    """Workers that run as another uid must be able to reach their
    workspace: every directory above it must let that uid search it."""
    if identities.run_as is not None:
        uid, gid = identities.run_as
    elif identities.session_uids is not None:
        uid = gid = identities.session_uids.start  # a stranger to every directory
    else:
        return
    path = root.resolve()
    for directory in [*reversed(path.parents)]:
        try:
            st = directory.stat()
        except OSError:
            continue
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if not st.st_mode & bit:
            who = f"uid {uid}" if identities.run_as else "the sessions' uids ([daemon] session_uid_range)"
            raise StartupError(
                f"workspaces under {root} cannot be reached by {who}: {directory} is mode "
                f"{stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}; let others search it "
                f"(chmod o+x {directory}), or put the state dir or [tools] workspace_dir elsewhere"
            )


# ---------------------------------------------------------------- the host


def detect_cgroups(cfg: Config) -> tuple[Cgroups | None, str]:
    """A cgroup per session where the kernel offers one we may manage; else
    say what holds instead.  Also the sessions' nice level, for the zygote
    (forked or exec'd after this) to set in each worker it forks."""
    nice = cfg.daemon.session_nice
    os.environ["SESSIOND_SESSION_NICE"] = str(nice)
    found, why = cgroup_detect(cfg.daemon.cgroups, nice)
    if found is not None:
        try:
            found.setup()
        except OSError as exc:
            why = f"cannot set up {found.describe()}: {exc.strerror or exc}"
            found = None
    weight = f"workers and tools at nice {nice}" if nice else "workers and tools at the daemon's CPU weight"
    if found is None:
        log.info("no cgroup per session: %s; processes are contained by the tool host and the zygote, "
                 "and limits enforced by rlimits and the memory sweep, per session only (no user's share "
                 "of tasks or memory: max_processes_per_uid, max_memory_mb_per_uid); %s", why, weight)
        return None, why
    cpu = f", all sessions at the CPU weight of one task at nice {nice}" if "cpu" in found.controllers else ""
    log.info("sessions get %s; %s%s", found.describe(), weight, cpu)
    return found, ""


def probe_sandbox(cfg: Config, identities: Identities, state_dir: Path, socket_path: Path,
                   config_path: Path | None, counted: set[str]) -> m.SandboxBoot:
    """What confines tools here, for the uid they will run as; every daemon
    path goes on the list no sandbox may show."""
    who = identities.run_as
    if who is None and identities.session_uids is not None:
        who = (identities.session_uids.start, identities.session_uids.start)
    hide = [state_dir, socket_path.parent]
    if config_path is not None:
        hide.append(config_path.resolve())
    if os.environ.get("CREDENTIALS_DIRECTORY"):
        hide.append(Path(os.environ["CREDENTIALS_DIRECTORY"]))
    try:
        uid, gid = who if who is not None else (None, None)
        return sandbox.probe(cfg.sandbox, uid, gid, hide, counted)
    except sandbox.SandboxUnavailable as exc:
        raise StartupError(str(exc)) from exc


def check_store_driver(cfg: Config) -> None:
    if cfg.store.backend == "postgres" and importlib.util.find_spec("psycopg") is None:
        raise StartupError("[store] backend = \"postgres\" needs the PostgreSQL driver, which is not "
                           f"installed: {install_command('cluster')}")
