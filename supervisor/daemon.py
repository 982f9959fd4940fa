"""sessiond's process: the zygote, the composition root, the loop, graceful stop.

Start-up order matters:
1. config, state directory and socket path are checked first
   (supervisor.startup.check), so a bad setting is a one-line error and
   exit code, never a traceback later;
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
import gc
import logging
import os
import resource
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import setproctitle

from ipc import messages as m
from ipc.loop import run as run_loop
from ipc.linux import large_allocations_mapped, set_dumpable
from supervisor.errors import StartupError
from supervisor import __version__
from supervisor.spawn import mcplist, preload, seams
from supervisor.ops import sdnotify
from supervisor.spawn.cgroups import Cgroups
from supervisor.config import Config, daemon_socket_path, default_state_dir
from supervisor.ops import metrics, tracing_config
from supervisor.ops.reload import Reloader
from supervisor.core import fdbudget
from supervisor.host import fds as host_fds
from supervisor.core.manager import SessionManager
from supervisor.core.recorder import NO_METRICS
from supervisor.core.mcpcatalog import McpCatalog
from supervisor.core import drainreq, fencing
from supervisor.core.admission import Identities
from supervisor.host.users import listening_group
from supervisor import startup
from supervisor.api.server import ControlServer
from supervisor.spawn.spawner import ZygoteSpawner
from supervisor.store.state_store import StateStore, StoreError

# supervisor/cluster/: imported only where configured (tests/test_daemon_imports.py).
if TYPE_CHECKING:
    from supervisor.cluster.fronts import Fronts  # (psycopg: the optional `cluster` extra)
    from supervisor.cluster.ray_spawner import RaySpawner

__all__ = ["StartupError", "run_daemon"]

log = logging.getLogger("sessiond")

# The longest the collector's own passes stay off for the start-up load (a
# load that cannot end, for want of fds, must not leave them off for good).
_GC_OFF_SECS = 600.0


class Spawner(seams.Spawner, Protocol):
    """What the daemon itself needs of its spawner, beyond the seam."""

    def attach(self, loop: asyncio.AbstractEventLoop) -> None: ...


def fd_clamp_here(cfg: Config) -> str:
    """For `config check`: whether max_concurrent_sessions fits the fds a
    daemon started from this shell could have (the unit's LimitNOFILE=
    decides where it runs); '' when it does."""
    return fdbudget.FdBudget.of(host_fds.nofile_limit(hard=True), cfg).clamped(cfg)


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
    host_fds.raise_nofile_limit()
    state_dir = state_dir or default_state_dir(cfg)
    socket_path = socket_path or daemon_socket_path(cfg)
    # The lock's fd is held until this process exits; the zygote (close_fds) does not inherit it.
    found = startup.check(cfg, state_dir, socket_path, config_path)
    identities, inherited, cgroups, sandbox_boot = found.identities, found.inherited, found.cgroups, found.sandbox
    clustered = cfg.cluster.backend == "ray"
    spawner: Spawner
    if clustered:
        from supervisor.cluster import wiring as cluster  # Ray's side: only when configured
        try:
            spawner = cluster.join(cfg)
        except cluster.ClusterUnavailable as exc:
            raise StartupError(str(exc)) from exc
    else:
        spawner = ZygoteSpawner(preload=preload.modules(cfg), expose=os.geteuid() == 0 and any(identities))
        spawner.start()  # before any loop or thread exists
    try:
        if inherited is not None:
            sock, bound = inherited, False
        else:
            sock = startup.bind_socket(socket_path, int(cfg.daemon.socket_mode, 8), cfg.daemon.socket_group)
            bound = True
        # Who is admitted: the socket's group, the one policy for the socket and every re-check.
        identities = identities._replace(socket_gid=listening_group(sock, cfg.daemon.socket_group))
        metrics_sock: socket.socket | None = None
        try:
            metrics_sock = startup.bind_metrics(cfg)
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
    background.append(loop.create_task(_collect_while_loading(manager)))
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
                                              per_session, tracer.stats, lambda: manager.loading)
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
        fds=fdbudget.at_start(cfg),  # the live sessions the daemon's fds hold
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
    """The sessions on disk: listed now and loaded in the background
    while the daemon serves (supervisor.core.loading); in cluster mode
    all loaded now (other daemons' messages name them)."""
    try:
        if parts.fronts is not None:
            parts.fronts.start(loop, parts.manager, parts.manager.holding)  # listening first: nothing said meanwhile is missed
            parts.manager.load_all()
        elif listed := parts.manager.start_loading():
            log.info("loading %d session(s) from disk in the background; serving meanwhile", listed)
    except StoreError as exc:  # the database went away since it was opened
        # Not chained: the driver's error under it may quote the DSN, password and all.
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
        raise StartupError(str(exc)) from exc  # (a file of ours: no secret in it)
    except OSError as exc:
        raise StartupError(f"{state_dir / 'front-id'}: cannot write this daemon's name there: "
                           f"{exc.strerror or exc}") from exc
    try:
        store = PgStateStore(cfg.store.dsn, retry_secs=cfg.store.retry_secs, front=front,
                             check_claim=claim_check(front))
    except StoreError as exc:
        # Not chained, here and below: the driver's error under it may quote the DSN, password and all.
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


async def _collect_while_loading(manager: SessionManager) -> None:
    """While the start-up load runs, the cyclic collector's own passes are
    off and its young generations are collected every 0.1 s: a full pass
    walks every session loaded so far (seconds at 100,000), and the growing
    heap would set one off again and again, each a stall of the loop (665 ms
    measured) and together half the load's time.  Garbage that outlives two
    young passes waits for the one full pass at the end, which then freezes
    what was loaded (as start-up's `gc.freeze` did what came before)."""
    if manager.loading is None:
        return
    gc.disable()
    try:
        deadline = asyncio.get_running_loop().time() + _GC_OFF_SECS
        while manager.loading is not None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            gc.collect(1)
    finally:
        gc.enable()
    await manager.loaded()
    gc.collect()
    gc.freeze()


def _status_line(manager: SessionManager) -> str:
    live = manager.live_workers()
    counts: dict[str, int] = {}
    for s in manager.sessions.values():
        counts[s.state.value] = counts.get(s.state.value, 0) + 1
    loading = manager.loading
    return (
        f"{len(manager.sessions)} sessions: {live} live, {counts.get('hibernated', 0)} hibernated, "
        f"{counts.get('failed', 0)} failed" + (f"; loading {loading[0]} of {loading[1]}" if loading else "")
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

