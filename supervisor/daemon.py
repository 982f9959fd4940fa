"""sessiond's process: start-up checks, the zygote, the loop, graceful stop.

Start-up order matters:
1. config, state directory and socket path are checked first, so a bad
   setting is a one-line error and exit code, never a traceback later;
2. the zygote is forked while this process still has no thread and no
   event loop (forking later would copy a running loop into the child);
3. only then is the socket bound and the loop started.

Signals only set an event (gunicorn's lesson: nothing runs inside a handler);
the loop does the stopping: stop accepting, let running turns finish for
`shutdown_grace_secs`, stop the workers, flush, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import fcntl
import gc
import importlib.util
import logging
import os
import pwd
import resource
import shutil
import signal
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import setproctitle

from ipc.install import install_command
from ipc import messages as m
from ipc.loop import run as run_loop
from ipc.linux import large_allocations_mapped, set_dumpable
from supervisor.errors import StartupError
from supervisor import __version__
from supervisor.spawn import mcplist, preload, sandbox, seams
from supervisor.ops import sdnotify
from supervisor.spawn.cgroups import Cgroups
from supervisor.spawn.cgroups_detect import detect as cgroup_detect
from supervisor.config import (
    Config,
    daemon_socket_path,
    default_state_dir,
    metrics_address,
    uid_range,
    workspace_root,
)
from supervisor.ops import metrics, tracing_config
from supervisor.ops.reload import Reloader
from supervisor.core.manager import SessionManager
from supervisor.core.recorder import NO_METRICS
from supervisor.core.mcpcatalog import McpCatalog
from supervisor.core import drainreq, fencing
from supervisor.core.admission import Identities
from supervisor.host.users import listening_group, resolve_group
from supervisor.api.server import ControlServer
from supervisor.spawn.spawner import ZygoteSpawner
from supervisor.store.state_store import StateStore, StoreError

# supervisor/cluster/: imported only where configured (tests/test_daemon_imports.py).
if TYPE_CHECKING:
    from supervisor.cluster.fronts import Fronts  # (psycopg: the optional `cluster` extra)
    from supervisor.cluster.ray_spawner import RaySpawner

__all__ = ["StartupError", "run_daemon"]

log = logging.getLogger("sessiond")


class Spawner(seams.Spawner, Protocol):
    """What the daemon itself needs of its spawner, beyond the seam."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None: ...


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
            raise StartupError(f"{what} {path}: cannot check {directory}: {exc.strerror}") from None
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
        raise StartupError(f"cannot open the lock file {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"state directory {path} is in use by another sessiond (pid {holder}, which holds "
            f"{lock_path}); stop that daemon first, or give this one its own --state-dir"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise StartupError(f"cannot lock {lock_path}: {exc.strerror}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise StartupError(f"state directory {path} is not usable: cannot write {lock_path}: "
                           f"{exc.strerror}") from None
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
        ) from None
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
        ) from None
    check_ancestors(path, "state directory")  # now with what we created


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
        raise StartupError(f"cannot create the socket directory {path.parent}: {exc.strerror}") from None
    check_ancestors(path.parent, "socket directory")
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
        if _socket_in_use(path):
            raise StartupError(f"another sessiond is already listening on {path}")
        path.unlink()
    if len(os.fsencode(str(path))) >= 108:
        raise StartupError(f"socket path {path} is too long for a Unix socket (max 107 bytes)")


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


def _cgroups(cfg: Config) -> tuple[Cgroups | None, str]:
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


def _probe_sandbox(cfg: Config, identities: Identities, state_dir: Path, socket_path: Path,
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
        raise StartupError(str(exc)) from None


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


def resolve_worker_user(cfg: Config) -> tuple[int, int] | None:
    """[daemon] worker_user as (uid, gid), or None to run workers as we run."""
    name = cfg.daemon.worker_user
    if not name:
        return None
    try:
        entry = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise StartupError(f"[daemon] worker_user: no such user {name!r}") from None
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise StartupError(
            f"[daemon] worker_user = {name!r} needs the daemon to run as root "
            f"(it runs as uid {os.geteuid()})"
        )
    return entry.pw_uid, entry.pw_gid


def bind_socket(path: Path, mode: int, group: str = "") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o777 & ~mode)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot bind {path}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    if group:
        os.chown(path, -1, resolve_group(group))
    os.chmod(path, mode)
    sock.listen(4096)
    sock.setblocking(False)
    return sock


def _inherited_socket() -> socket.socket | None:
    """A listening socket passed by systemd socket activation, if any."""
    socks = sdnotify.listen_fds()
    for extra in socks[1:]:
        extra.close()
    if socks:
        socks[0].setblocking(False)
        return socks[0]
    return None


def _raise_nofile_limit() -> None:
    # Every session costs the daemon a socket and a log fd; systemd's default
    # soft limit of 1024 is far below its hard limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_daemon(
    cfg: Config,
    state_dir: Path | None = None,
    socket_path: Path | None = None,
    config_path: Path | None = None,
) -> int:
    # Our environment holds the provider's key and our memory everyone's
    # sessions: a process of our uid (a tool, when workers run as we do)
    # must not read /proc/<us>/environ or mem, nor ptrace us.  The zygote
    # and the workers inherit the flag through fork.
    set_dumpable(False)
    # Before the zygote is forked: it renames itself, and so do workers.
    setproctitle.setproctitle("sessiond: daemon")
    faulthandler.enable()  # a watchdog SIGABRT leaves the stuck stack in the journal
    large_allocations_mapped()  # clients' large buffers go back to the system when freed
    _raise_nofile_limit()
    state_dir = state_dir or default_state_dir(cfg)
    socket_path = socket_path or daemon_socket_path(cfg)
    # Held until this process exits; the zygote (close_fds) does not inherit it.
    lock_fd = check_state_dir(state_dir)  # noqa: F841 (kept open on purpose)
    if cfg.daemon.socket_group:
        resolve_group(cfg.daemon.socket_group)
    inherited = _inherited_socket()
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
    cgroups = _cgroups(cfg) if not clustered else (None, "cluster mode: workers run on Ray node hosts")
    # What the kernel counts for sessions besides what the daemon reads in
    # /proc (cluster mode: the workers' nodes measure them).
    counted = {"memory", "pids"} if clustered else cgroups[0].controllers if cgroups[0] is not None else set()
    sandbox_boot = _probe_sandbox(cfg, identities, state_dir, socket_path, config_path, counted)

    _check_store_driver(cfg)
    spawner: Spawner
    if clustered:
        from supervisor.cluster import wiring as cluster  # Ray's side: only when configured
        try:
            spawner = cluster.join(cfg)
        except cluster.ClusterUnavailable as exc:
            raise StartupError(str(exc)) from None
    else:
        spawner = ZygoteSpawner(preload=preload.modules(cfg), expose=os.geteuid() == 0 and any(identities))
        spawner.start()  # before any loop or thread exists
    try:
        if inherited is not None:
            sock, bound = inherited, False
        else:
            sock = bind_socket(socket_path, int(cfg.daemon.socket_mode, 8), cfg.daemon.socket_group)
            bound = True
        # Who is admitted: the socket's group, the one policy for the socket and every re-check.
        identities = identities._replace(socket_gid=listening_group(sock, cfg.daemon.socket_group))
        metrics_sock: socket.socket | None = None
        try:
            metrics_sock = bind_metrics(cfg)
            return run_loop(_serve(cfg, config_path, state_dir, socket_path, sock, spawner, identities,
                                   sandbox_boot, cgroups, metrics_sock))
        finally:
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    socket_path.unlink()
            if cfg.daemon.metrics_listen.startswith("/") and metrics_sock is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(cfg.daemon.metrics_listen)
    finally:
        spawner.close()


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
        ) from None


async def _serve(
    cfg: Config,
    config_path: Path | None,
    state_dir: Path,
    socket_path: Path,
    sock: socket.socket,
    spawner: Spawner,
    identities: Identities,
    sandbox_boot: m.SandboxBoot | None,
    cgroups: tuple[Cgroups | None, str],
    metrics_sock: socket.socket | None = None,
) -> int:
    """The daemon's life on its loop: build, load, listen, run until a
    signal, stop."""
    loop = asyncio.get_running_loop()
    spawner.attach(loop)
    spawner.keep_spares(cfg.daemon.spare_workers)
    parts = _build(cfg, config_path, state_dir, spawner, identities, sandbox_boot, cgroups,
                   metrics_sock is not None)
    manager, server = parts.manager, parts.server
    _load(loop, parts)
    metrics_server: asyncio.AbstractServer | None = None
    if metrics_sock is not None and parts.recorder is not None:
        metrics_server = await metrics.serve(metrics_sock, parts.recorder)
        log.info("metrics on %s ([daemon] metrics_listen)", metrics.address_of(metrics_sock))
    await server.start(sock)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, parts.reloader.reload)
    _say_provider(cfg)
    where = sock.getsockname() or str(socket_path)
    log.info("sessiond %s (pid %d) listening on %s; state in %s", __version__, os.getpid(), where, state_dir)
    log.info("try: SESSIOND_SOCKET=%s %s create", where, _sessionctl_command())
    # What start-up made (modules, config, every loaded session) lives as
    # long as we do: out of the cyclic collector's full passes, which would
    # otherwise walk it all again every time (with ipc's untracked messages:
    # ping p99 with 50 busy sessions 15 -> 2.6 ms, bench/load.py).
    gc.collect()
    gc.freeze()
    sdnotify.ready(_status_line(manager))
    background = _background(loop, manager)
    await stop.wait()
    await _stop(cfg, parts, metrics_server, background)
    return 0


class _Parts(NamedTuple):
    manager: SessionManager
    server: ControlServer
    recorder: metrics.PrometheusRecorder | None  # with metrics on
    fronts: Fronts | None
    reloader: Reloader  # SIGHUP and `sessionctl reload`


def _build(
    cfg: Config,
    config_path: Path | None,
    state_dir: Path,
    spawner: Spawner,
    identities: Identities,
    sandbox_boot: m.SandboxBoot | None,
    cgroups: tuple[Cgroups | None, str],
    with_metrics: bool,
) -> _Parts:
    """The composition root: every part of the daemon, each given its
    collaborators as it is built (the core's own parts are built by
    SessionManager, from what it is given here)."""
    # Connected only now, after the zygote was forked: no worker may inherit
    # the daemon's database connection.
    store, fronts = _open_store(cfg, state_dir)
    tracer = tracing_config.build(cfg.tracing)  # (the exporter's thread: after the zygote's fork)
    manager: SessionManager
    server: ControlServer
    recorder: metrics.PrometheusRecorder | None = None
    if with_metrics:
        per_session = cfg.daemon.metrics_top_sessions if cfg.daemon.metrics_per_session else 0
        # Reads what it counts when scraped, from the parts built below.
        recorder = metrics.PrometheusRecorder(lambda: manager.sessions.values(), lambda: len(server.clients),
                                              per_session, tracer.stats)
    # The lazy MCP servers' tool lists, in the config sessions run with (cluster mode: none).
    ray: RaySpawner | None = None  # cluster mode: the spawner is cluster.join's
    if cfg.cluster.backend == "ray":
        from supervisor.cluster.ray_spawner import RaySpawner  # only when configured
        ray = spawner if isinstance(spawner, RaySpawner) else None
    catalog = McpCatalog(None if ray is not None else mcplist.lister_for(
        state_dir, identities.run_as, identities.session_uids, sandbox_boot), lambda new: manager.reload(new))
    manager = SessionManager(
        catalog.attach(cfg), state_dir, spawner, identities=identities,
        sandbox=sandbox_boot, cgroups=cgroups[0], cgroups_why=cgroups[1], store=store, metrics=recorder or NO_METRICS,
        # Another daemon may take a session over (the store fences): release, claim back.
        holds=fronts.holds if fronts is not None else fencing.Fencing(),
        open_stored=fronts.open_stored if fronts is not None else None,
        remote=ray, tracer=tracer,  # cluster mode: remote workers' memory as their nodes measure it
    )
    drain = drainreq.no_nodes(manager.is_admin)  # every session here: `sessionctl drain` is refused
    if ray is not None:
        from supervisor.cluster.drain import Drainer
        drain = Drainer(manager, ray, manager.events, manager.workers).handle

    def apply(new: Config) -> None:
        preload.reloaded(manager.config, new)
        manager.reload(catalog.attach(new))
        spawner.keep_spares(new.daemon.spare_workers)

    reloader = Reloader(config_path, lambda: manager.config, apply, lambda: _status_line(manager))
    server = ControlServer(manager, metrics=recorder or NO_METRICS, drain=drain,
                           reload=reloader.reload, tracer=tracer)
    return _Parts(manager, server, recorder, fronts, reloader)


def _load(loop: asyncio.AbstractEventLoop, parts: _Parts) -> None:
    try:
        if parts.fronts is not None:
            parts.fronts.start(loop, parts.manager, parts.manager.holding)  # listening first: nothing said meanwhile is missed
        parts.manager.load_all()
    except StoreError as exc:  # the database went away since it was opened
        raise StartupError(f"cannot read the sessions: {exc}") from None


def _say_provider(cfg: Config) -> None:
    if cfg.provider.api_key_env and not os.environ.get(cfg.provider.api_key_env):
        # Said now, not at the first turn of the first session.
        log.error(
            "provider.api_key_env names %s, which is not set in sessiond's environment: "
            "agent turns will fail until it is (set it and restart)", cfg.provider.api_key_env,
        )
    if (cfg.provider.base_url or cfg.provider.model) and cfg.provider.missing():
        log.error("[provider] is incomplete: %s; until then agent sessions are refused",
                  cfg.provider.missing_text())
    elif not cfg.provider.configured:
        log.info(
            "no [provider] configured: sessions run the echo handler; set [provider] base_url and "
            "model in config.toml to run the LLM agent"
        )


def _background(loop: asyncio.AbstractEventLoop, manager: SessionManager) -> list[asyncio.Task[None]]:
    """The sweep, and systemd's watchdog or status line."""
    background: list[asyncio.Task[None]] = [loop.create_task(manager.supervise())]
    interval = sdnotify.watchdog_interval_secs()
    if interval:
        background.append(loop.create_task(sdnotify.watchdog_loop(interval, lambda: _status_line(manager))))
    elif os.environ.get("NOTIFY_SOCKET"):
        background.append(loop.create_task(_status_loop(manager)))
    return background


async def _stop(cfg: Config, parts: _Parts, metrics_server: asyncio.AbstractServer | None,
                background: list[asyncio.Task[None]]) -> None:
    log.info("shutting down: no new connections; letting running turns finish (up to %gs)",
             cfg.daemon.shutdown_grace_secs)
    sdnotify.stopping()
    parts.server.stop_accepting()
    if metrics_server is not None:
        metrics_server.close()
    await parts.server.settle(cfg.daemon.shutdown_grace_secs)  # an `rm` half done would come back
    await parts.manager.shutdown(cfg.daemon.shutdown_grace_secs)
    if parts.fronts is not None:
        parts.fronts.close()  # after its workers are gone: others may claim its sessions at once
    parts.server.close_clients()
    for task in background:
        task.cancel()
    log.info("stopped")


def _check_store_driver(cfg: Config) -> None:
    if cfg.store.backend == "postgres" and importlib.util.find_spec("psycopg") is None:
        raise StartupError("[store] backend = \"postgres\" needs the PostgreSQL driver, which is not "
                           f"installed: {install_command('cluster')}")


def _open_store(cfg: Config, state_dir: Path) -> tuple[StateStore | None, Fronts | None]:
    """The configured state store (None: the file store under state_dir)
    and, with PostgreSQL, this daemon's place among the daemons that may
    share the database: sessions are claimed when used (supervisor.cluster.fronts)."""
    if cfg.store.backend != "postgres":
        return None, None
    from supervisor.cluster.fronts import Fronts, claim_check, front_id
    from supervisor.store.postgres.store import PgStateStore  # the optional `cluster` extra

    try:
        front = front_id(state_dir)
    except StoreError as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        raise StartupError(f"{state_dir / 'front-id'}: cannot write this daemon's name there: "
                           f"{exc.strerror or exc}") from None
    try:
        store = PgStateStore(cfg.store.dsn, retry_secs=cfg.store.retry_secs, front=front,
                             check_claim=claim_check(front))
    except StoreError as exc:
        raise StartupError(f"[store] backend = \"postgres\": {exc}") from None
    log.info("state in PostgreSQL (%s)", store.where)
    try:
        return store, Fronts(store, cfg.store.dsn, cfg.store.retry_secs, cfg.cluster.front_lease_secs, front)
    except StoreError as exc:
        raise StartupError(str(exc)) from None


def _sessionctl_command() -> str:
    """How to run sessionctl from here: plain when it is on PATH, else the
    one installed beside this interpreter (e.g. .venv/bin/sessionctl)."""
    if shutil.which("sessionctl"):
        return "sessionctl"
    beside = Path(sys.executable).parent / "sessionctl"
    return str(beside) if beside.exists() else "sessionctl"


def _status_line(manager: SessionManager) -> str:
    live = manager.live_workers()
    counts: dict[str, int] = {}
    for s in manager.sessions.values():
        counts[s.state.value] = counts.get(s.state.value, 0) + 1
    return (
        f"{len(manager.sessions)} sessions: {live} live, {counts.get('hibernated', 0)} hibernated, "
        f"{counts.get('failed', 0)} failed"
    )


async def _status_loop(manager: SessionManager) -> None:
    """STATUS= updates when systemd listens but no watchdog is configured."""
    last = ""
    while True:
        line = _status_line(manager)
        if line != last:
            sdnotify.status(line)
            last = line
        await asyncio.sleep(5.0)


def configure_logging(level: str, log_format: str = "text") -> None:
    sdnotify.configure_logging(level.upper(), log_format=log_format)

