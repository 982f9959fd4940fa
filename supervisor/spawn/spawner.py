"""The daemon's side of the zygote: spawning, signalling and killing workers.

`ZygoteSpawner` is the first implementation of the `Spawner` seam
(`supervisor.spawn.seams`): it owns the zygote process (`session_worker.zygote`,
which this module never imports: the zygote is started by name, in a forked
child before the daemon has a loop or a thread, or by exec) and every
worker's pidfd.  Exit statuses arrive from the zygote and go to `on_exit`.

If the zygote itself dies, the daemon starts a new one with fork+exec
(`python -P -m session_worker.zygote`): forking the daemon again is what we
avoid.  `-P` because `-m` would otherwise put the daemon's working
directory first on sys.path, and a package planted there would run with the
daemon's rights.  A zygote that keeps dying is restarted after an
exponential backoff (`ZygoteBackoff`), not in a tight loop; meanwhile spawn
requests fail with `ZygoteDied` and the daemon serves everything else.

Runs in the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable

import msgspec

from ipc import messages as m
from ipc import zygote_wire as zw
from supervisor.spawn.pidfd import PidFd
from supervisor.errors import Capacity, StartupError, ZygoteDied
from supervisor.spawn import ceilings

__all__ = ["ZygoteBackoff", "ZygoteSpawner"]

log = logging.getLogger("sessiond.zygote")

_from_zygote = msgspec.msgpack.Decoder(zw.FromZygote)
_encode = msgspec.msgpack.Encoder().encode
_MAX_PACKET = 4096
_SIGKILL = signal.SIGKILL  # (the spawner has a method named `signal`)
# How often to look whether a reaped worker's process group is empty yet.
_RETIRE_CHECK_SECS = 0.25
# The directory holding our packages, for the re-exec'd zygote.
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ZYGOTE_MODULE = "session_worker.zygote"
# A framework's import takes seconds; one that hangs must not hold the start-up for ever.
_PRELOAD_TIMEOUT_SECS = 300.0


class ZygoteBackoff:
    """When to start the next zygote after one died (pure: no I/O).

    A zygote that lived `stable_secs` died of something passing: the next
    one starts at once.  One that died sooner is failing to run at all
    (a broken install, a crash at import, something killing it): wait
    `initial_secs`, doubling with each quick death, up to `max_secs`."""

    __slots__ = ("failures", "initial_secs", "max_secs", "stable_secs")

    def __init__(self, initial_secs: float = 0.1, max_secs: float = 30.0, stable_secs: float = 10.0) -> None:
        self.initial_secs = initial_secs
        self.max_secs = max_secs
        self.stable_secs = stable_secs
        self.failures = 0

    def delay_after_death(self, lived_secs: float) -> float:
        if lived_secs >= self.stable_secs:
            self.failures = 0
        delay = 0.0 if self.failures == 0 else min(
            self.initial_secs * 2 ** (self.failures - 1), self.max_secs)
        self.failures += 1
        return delay


def _no_exit(pid: int, code: int | None, sig: int | None) -> None:
    pass


def _nothing() -> None:
    pass


class ZygoteSpawner:
    """Daemon-side owner of the zygote and of every worker process.

    The one place in the daemon that signals workers; exit statuses arrive
    here (from the zygote) and go to `on_exit`.  `start()` forks the first
    zygote and must be called before the event loop exists.
    """

    def __init__(
        self,
        on_exit: Callable[[int, int | None, int | None], None] | None = None,
        on_zygote_lost: Callable[[], None] | None = None,
        preload: list[str] | None = None,
        expose: bool = False,
    ) -> None:
        # Where exits go: given here by an owner built first (the node
        # host); the daemon's owner (WorkerOwner) is built after the fork,
        # and routes them itself.
        self.on_exit: Callable[[int, int | None, int | None], None] = on_exit or _no_exit
        self.on_zygote_lost: Callable[[], None] = on_zygote_lost or _nothing
        self._sock: socket.socket | None = None
        self._pid = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._tokens = 0
        self._pending: dict[int, asyncio.Future[tuple[int, socket.socket]]] = {}
        self._spares = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._started_at = 0.0  # time.monotonic() when the current zygote started
        self._backoff = ZygoteBackoff()
        self._restart_timer: asyncio.TimerHandle | None = None
        self._restart_at = 0.0
        # Every worker we were given, by pid, until its process group is
        # empty (see `_retire`): what `signal` and `kill_tree` act through.
        self._workers: dict[int, PidFd] = {}
        # What every zygote is told to do before it forks (supervisor.spawn.preload,
        # session_worker.worker._reach); with either, it says how it went (Preloaded).
        self._preload = list(preload or [])
        self._expose = expose

    @property
    def zygote_pid(self) -> int:
        return self._pid

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        daemon_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                parent.close()
                # The worker side is loaded here, in the child only: the
                # daemon itself never imports it.
                zygote = importlib.import_module(_ZYGOTE_MODULE)
                code = zygote.zygote_main(child, daemon_pid, self._preload, self._expose)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        child.close()
        self._sock, self._pid = parent, pid
        self._started_at = time.monotonic()

    def start_by_exec(self) -> None:
        """Start the zygote by exec rather than fork: for a process that has
        threads already (a Ray node host), where forking is what we avoid."""
        self._restart_by_exec()

    def _restart_by_exec(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = child.fileno()
        # -P: no working directory (nor script directory) on sys.path; the
        # operator's PYTHONPATH is kept, after the directory our own code
        # came from, so the new zygote runs the code the daemon runs.
        # Nothing of Ray's either (a node host's environment: its auth
        # token, its addresses): the workers do not speak to Ray.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_CODE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", _ZYGOTE_MODULE, "--fd", str(fd),
                 "--daemon-pid", str(os.getpid()), "--preload", ",".join(self._preload),
                 *(["--expose"] if self._expose else [])],
                pass_fds=[fd], close_fds=True, env=env,
            )
        finally:
            child.close()
        self._sock, self._pid = parent, self._proc.pid
        self._started_at = time.monotonic()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
        if self._loop is None and (self._preload or self._expose):
            self._await_preload()
        self._loop = loop
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, _MAX_PACKET, 2)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lost()
                return
            match _from_zygote.decode(data):
                case zw.Spawned(token=token, pid=pid):
                    fut = self._pending.pop(token, None)
                    if len(fds) != 2:
                        log.error("the zygote sent %d fds for worker %d, not its socket and pidfd",
                                  len(fds), pid)
                        for fd in fds:
                            os.close(fd)
                        if fut is not None and not fut.done():
                            fut.set_exception(ZygoteDied("the zygote sent no socket or pidfd"))
                        continue
                    conn = socket.socket(fileno=fds[0])
                    self._workers[pid] = PidFd(fds[1], pid)
                    if fut is not None and not fut.done():
                        fut.set_result((pid, conn))
                    else:  # nobody waits for it any more
                        conn.close()
                        self.signal(pid, signal.SIGKILL)
                case zw.SpawnFailed(token=token, errno=code, message=why):
                    # The zygote lives on; this create (or revive) is told why.
                    fut = self._pending.pop(token, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(Capacity(ceilings.fork_refusal(code, why)))
                        fut.exception()  # (a create given up meanwhile does not wait for it)
                case zw.Exited(pid=pid, code=code, signal=sig):
                    self.on_exit(pid, code, sig)
                    self._retire(pid)
                case zw.Preloaded(error=error) if error:  # a zygote started again: it serves all the same
                    log.error("the new zygote: %s; sessions that need it fail at boot", error)

    def _await_preload(self) -> None:
        """At start, before the daemon listens: the first zygote's word on
        its preload (a blocking read: nothing else is served yet).  A module
        that did not import, or a Python the sessions cannot read, stops the
        start-up, named."""
        assert self._sock is not None
        self._sock.settimeout(_PRELOAD_TIMEOUT_SECS)
        try:
            data = self._sock.recv(_MAX_PACKET)
        except TimeoutError as exc:
            raise StartupError(f"the zygote did not finish preloading {', '.join(self._preload)} within "
                               f"{_PRELOAD_TIMEOUT_SECS:.0f}s ([daemon] preload_modules, the handlers' modules)") from exc
        except OSError as exc:
            raise StartupError(f"the zygote died while preloading: {exc}") from exc
        finally:
            self._sock.settimeout(None)
        if not data:
            raise StartupError("the zygote died while preloading (its log lines say why)")
        report = _from_zygote.decode(data)
        if isinstance(report, zw.Preloaded) and report.error:
            raise StartupError(report.error)
        if self._preload:
            log.info("the zygote preloaded %s", ", ".join(self._preload))

    def _lost(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._reap_zygote_when_gone()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ZygoteDied("the zygote died"))
        self._pending.clear()
        if self._closing:
            return
        # Its workers died with it (PDEATHSIG); their exits are reported by
        # the daemon as crashes of the sessions that owned them.
        self.on_zygote_lost()
        for pid in list(self._workers):
            self._retire(pid)
        self._schedule_restart(time.monotonic() - self._started_at)

    def _schedule_restart(self, lived_secs: float) -> None:
        assert self._loop is not None
        delay = self._backoff.delay_after_death(lived_secs)
        log.error("the zygote (pid %d) died after %.1fs; starting a new one%s", self._pid,
                  lived_secs, f" in {delay:.1f}s" if delay else "")
        self._restart_at = time.monotonic() + delay
        self._restart_timer = self._loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        self._restart_timer = None
        if self._closing or self._loop is None:
            return
        try:
            self._restart_by_exec()
        except OSError as exc:  # e.g. out of fds or processes: try again later
            log.error("cannot start a new zygote: %s", exc)
            self._schedule_restart(0.0)
            return
        self.attach(self._loop)
        self.keep_spares(self._spares)

    def _reap_zygote_when_gone(self) -> None:
        """The zygote closed its end: it is dying (it kills its workers
        first).  Reap it once it has exited, from the loop, without ever
        blocking the loop in waitpid: its pidfd becomes readable then."""
        assert self._loop is not None
        loop, pid, proc = self._loop, self._pid, self._proc
        self._proc = None
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # already reaped

        def reap() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            if proc is not None:
                proc.poll()  # waitpid(WNOHANG), and Popen knows it is done
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

        loop.add_reader(fd, reap)

    def _reap_zygote(self) -> None:
        """At close, when the loop is done: wait for the zygote to finish."""
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=5)
            self._proc = None
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._pid, 0)

    def request(self) -> asyncio.Future[tuple[int, socket.socket]]:
        """Order a worker now, collect it later (so the daemon can do its
        own work, e.g. an fsync, while the zygote forks or hands over a
        spare).  Resolves to its pid and the daemon's end of its socket."""
        fut: asyncio.Future[tuple[int, socket.socket]] = asyncio.get_running_loop().create_future()
        if self._sock is None:
            wait = max(0.0, self._restart_at - time.monotonic())
            fut.set_exception(ZygoteDied(
                f"the zygote died and is being restarted (next attempt in {wait:.1f}s); "
                "no worker can be started until then"))
            return fut
        self._tokens += 1
        try:
            self._sock.send(_encode(zw.SpawnWorker(token=self._tokens)))
        except OSError as exc:
            fut.set_exception(ZygoteDied(f"cannot reach the zygote: {exc}"))
            return fut
        self._pending[self._tokens] = fut
        return fut

    async def spawn(self) -> tuple[int, socket.socket]:
        """Fork a worker (or take a spare); its pid and the daemon's end of its socket."""
        return await self.request()

    def keep_spares(self, count: int) -> None:
        self._spares = count
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(_encode(zw.KeepSpares(count=count)))

    def signal(self, pid: int, sig: int) -> None:
        """Signal a worker's whole process group (the worker and its tools),
        through its pidfd: safe even after the worker was reaped (see
        supervisor/spawn/pidfd.py).  A pid we hold no pidfd for is not ours (any
        more): nothing is signalled by number."""
        worker = self._workers.get(pid)
        if worker is not None:
            worker.send_group(sig)

    def kill_tree(self, pid: int, others: Iterable[PidFd] = (), sig: int = _SIGKILL) -> None:
        """Signal a worker's process group and its descendants that left
        the group (tools that called setsid, daemons that double-forked),
        each through its own pidfd.  SIGKILL is final, so it spends their
        handles: they are closed here, as nothing else would close them
        once the session is gone (a closed handle counts as exited)."""
        self.signal(pid, sig)
        for other in others:
            other.send(sig)
            if sig == _SIGKILL:
                other.close()

    def tree_alive(self, pid: int, others: Iterable[PidFd] = ()) -> bool:
        """Whether anything of that tree is left (zombies count in the
        group, not among `others`)."""
        worker = self._workers.get(pid)
        if worker is not None and worker.send_group(0):
            return True
        return any(not o.exited() for o in others)

    def placement(self, pid: int) -> tuple[int, str | None]:
        return pid, None  # this machine

    def _retire(self, pid: int) -> None:
        """The worker was reaped.  Its pidfd still names its process group,
        so a stop's grace period can still reach tools left in it; close the
        pidfd once that group is empty, checking again until it is."""
        worker = self._workers.get(pid)
        if worker is None:
            return
        if self._closing or self._loop is None or not worker.send_group(0):
            self._workers.pop(pid).close()
            return
        self._loop.call_later(_RETIRE_CHECK_SECS, self._retire, pid)


    def close(self) -> None:
        """Tell the zygote to go (it kills what is left) and reap it."""
        self._closing = True
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        if self._sock is not None:
            if self._loop is not None:
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            self._reap_zygote()
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()
