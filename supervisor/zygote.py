"""The zygote: a small preloaded process that forks one worker per session.

Why: forking is cheap only from a small process with no threads and no
running event loop, and copy-on-write only pays when the parent's heap stays
still.  The daemon forks the zygote at start-up, before its loop or any
thread exists; the zygote imports `session_worker`, calls `gc.freeze()` and
from then on does nothing but fork on order and reap.

    daemon ──SEQPACKET── zygote ──fork──> worker (own process group)
      │   SpawnWorker + fd  ─►               │
      │   ◄─ Spawned{pid}, Exited{pid, code|signal}
      └────────── socketpair (framed msgpack) ┘

The zygote is the one process that calls waitpid for workers; it reports
every exit status to the daemon, decoded once (code or signal).  It is also
the child subreaper, so tool processes orphaned by a worker re-parent to it
and are reaped instead of haunting init.  PDEATHSIG ties each worker to the
zygote (SIGKILL) and the zygote to the daemon (SIGUSR1: when the daemon dies,
the zygote kills every worker's process group and every process that
re-parented to it, then exits), so nothing outlives the daemon.

If the zygote itself dies, the daemon starts a new one with fork+exec
(`python -P -m supervisor.zygote`): forking the daemon again is what we
avoid.  `-P` because `-m` would otherwise put the daemon's working
directory first on sys.path, and a `supervisor/` planted there would run
with the daemon's rights.  A zygote that keeps dying is restarted after an
exponential backoff (`ZygoteBackoff`), not in a tight loop; meanwhile spawn
requests fail with `ZygoteDied` and the daemon serves everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator

import msgspec

from ipc import messages as m
from supervisor.pidfd import PidFd
from ipc.linux import set_child_subreaper, set_dumpable, set_pdeathsig

__all__ = ["ZygoteBackoff", "ZygoteDied", "ZygoteSpawner", "zygote_main"]

log = logging.getLogger("sessiond.zygote")

_to_zygote = msgspec.msgpack.Decoder(m.ToZygote)
_from_zygote = msgspec.msgpack.Decoder(m.FromZygote)
_encode = msgspec.msgpack.Encoder().encode
_MAX_PACKET = 4096
_SIGKILL = signal.SIGKILL  # (the spawner has a method named `signal`)
# How often to look whether a reaped worker's process group is empty yet.
_RETIRE_CHECK_SECS = 0.25
# The directory holding our `supervisor` package, for the re-exec'd zygote.
_CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the zygote process


def _preload() -> None:
    import session_worker.echo  # noqa: F401
    import session_worker.main  # noqa: F401

    with contextlib.suppress(ImportError):
        import session_worker.agent  # noqa: F401


def zygote_main(sock: socket.socket, daemon_pid: int) -> int:
    """Runs in the zygote process until the daemon closes its end or dies."""
    # Not SIGKILL: when the daemon dies we still have work to do (below).
    set_pdeathsig(signal.SIGUSR1)
    # A forked zygote inherits the daemon's non-dumpable flag, but one
    # started by exec has it reset; the workers inherit ours.
    set_dumpable(False)
    if os.getppid() != daemon_pid:
        _kill_everything({})
        return 0
    # Ctrl-C in a terminal and a stray SIGTERM to the daemon's group are the
    # daemon's to handle; it stops us by closing the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_child_subreaper()
    _preload()

    parent_died = False

    def on_parent_death(signum: int, frame: object) -> None:
        nonlocal parent_died
        parent_died = True  # the loop sees it; the wakeup fd wakes the loop

    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGUSR1, on_parent_death)
    sock.setblocking(True)
    gc.collect()
    gc.freeze()

    workers: dict[int, int] = {}  # pid -> token
    # Forked ahead of demand and waiting for Boot: the daemon's end of each,
    # and its pidfd.
    spares: dict[int, tuple[socket.socket, int]] = {}
    keep_spares = 0
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    my_pid = os.getpid()

    def fork_worker(spare: bool) -> tuple[int, socket.socket, int]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            ours.close()
            # fork ignores CLOEXEC: drop the other spares' daemon ends and
            # pidfds, or this worker would keep them open.
            for other, other_pidfd in spares.values():
                other.close()
                os.close(other_pidfd)
            _worker_child(theirs.detach(), sock, wake_r, wake_w, my_pid, spare)
        # The daemon kills by pidfd, never by pid number.  Opened here, right
        # after fork: only we reap this child, and not before this line, so
        # the number cannot have passed to another process yet.
        pidfd = os.pidfd_open(pid)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also done by the child: whoever runs first
        theirs.close()
        return pid, ours, pidfd

    def reap() -> None:
        for pid, status in _reap_any():
            spare = spares.pop(pid, None)
            if spare is not None:
                spare[0].close()  # a spare that died unused: nobody to tell
                os.close(spare[1])
                continue
            if workers.pop(pid, None) is None:
                continue  # an orphaned tool process we adopted as subreaper
            code = os.waitstatus_to_exitcode(status)
            exited = m.Exited(pid=pid, code=code) if code >= 0 else m.Exited(pid=pid, signal=-code)
            with contextlib.suppress(OSError):
                sock.send(_encode(exited))

    running = True
    while running and not parent_died:
        # With spares to make, poll instead of blocking: an order always
        # comes first, a spare is forked only when nothing is waiting.
        events = sel.select(0 if len(spares) < keep_spares else None)
        if not events and len(spares) < keep_spares:
            pid, ours, pidfd = fork_worker(spare=True)
            spares[pid] = (ours, pidfd)
            continue
        for key, _ in events:
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                reap()
                continue
            try:
                data = sock.recv(_MAX_PACKET)
            except OSError:
                data = b""
            if not data:
                running = False
                break
            match _to_zygote.decode(data):
                case m.KeepSpares(count=count):
                    keep_spares = max(0, count)
                    while len(spares) > keep_spares:
                        _, (extra, extra_pidfd) = spares.popitem()
                        extra.close()  # EOF: the spare exits by itself
                        os.close(extra_pidfd)
                case m.SpawnWorker(token=token):
                    if spares:
                        pid, (ours, pidfd) = spares.popitem()
                    else:
                        pid, ours, pidfd = fork_worker(spare=False)
                    workers[pid] = token
                    try:
                        socket.send_fds(sock, [_encode(m.Spawned(token=token, pid=pid))],
                                        [ours.fileno(), pidfd])
                    finally:
                        ours.close()
                        os.close(pidfd)
        reap()

    signal.set_wakeup_fd(-1)
    for spare, spare_pidfd in spares.values():
        spare.close()
        os.close(spare_pidfd)
    _kill_everything({**workers, **dict.fromkeys(spares, 0)})
    return 0


def _kill_everything(workers: dict[int, int], settle_secs: float = 1.0) -> None:
    """The daemon is gone or done with us: nothing of ours may outlive it.

    Kill every worker's process group, then keep killing whatever is left
    among our children: tools that left their group (setsid) re-parent to us
    (we are the subreaper) when the worker above them dies.
    """
    # By number, safely: we are the only reaper of these pids and have not
    # reaped them, so each still names our worker's group.
    for pid in list(workers):
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + settle_secs
    while True:
        children = _my_children()
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for _ in _reap_any():
            pass
        if not children and not _my_children():
            return
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _reap_any() -> Iterator[tuple[int, int]]:
    """(pid, status) of every child that has exited, without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _my_children() -> list[int]:
    # The zygote is single-threaded: its main task lists all its children.
    pid = os.getpid()
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _worker_child(
    fd: int, zsock: socket.socket, wake_r: int, wake_w: int, zygote_pid: int, spare: bool
) -> None:
    """In the freshly forked worker: shed the zygote's plumbing, run, _exit."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        zsock.close()
        os.setpgid(0, 0)
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != zygote_pid:
            os._exit(1)
        from session_worker.main import run_worker

        code = run_worker(socket.socket(fileno=fd), warm_up=spare)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------- the daemon's side


class ZygoteDied(Exception):
    pass


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


class ZygoteSpawner:
    """Daemon-side owner of the zygote and of every worker process.

    The one place in the daemon that signals workers; exit statuses arrive
    here (from the zygote) and go to `on_exit`.  `start()` forks the first
    zygote and must be called before the event loop exists.
    """

    def __init__(self) -> None:
        self.on_exit: Callable[[int, int | None, int | None], None] = lambda pid, code, sig: None
        self.on_zygote_lost: Callable[[], None] = lambda: None
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
                code = zygote_main(child, daemon_pid)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        child.close()
        self._sock, self._pid = parent, pid
        self._started_at = time.monotonic()

    def _restart_by_exec(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = child.fileno()
        # -P: no working directory (nor script directory) on sys.path; the
        # operator's PYTHONPATH is kept, after the directory our own code
        # came from, so the new zygote runs the code the daemon runs.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_CODE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "supervisor.zygote", "--fd", str(fd),
                 "--daemon-pid", str(os.getpid())],
                pass_fds=[fd], close_fds=True, env=env,
            )
        finally:
            child.close()
        self._sock, self._pid = parent, self._proc.pid
        self._started_at = time.monotonic()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._sock is not None
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
                case m.Spawned(token=token, pid=pid):
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
                case m.Exited(pid=pid, code=code, signal=sig):
                    self.on_exit(pid, code, sig)
                    self._retire(pid)

    def _lost(self) -> None:
        assert self._sock is not None and self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._reap_zygote()
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

    def _reap_zygote(self) -> None:
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
            self._sock.send(_encode(m.SpawnWorker(token=self._tokens)))
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
                self._sock.send(_encode(m.KeepSpares(count=count)))

    def signal(self, pid: int, sig: int) -> None:
        """Signal a worker's whole process group (the worker and its tools),
        through its pidfd: safe even after the worker was reaped (see
        supervisor/pidfd.py).  A pid we hold no pidfd for is not ours (any
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


def _exec_main() -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m supervisor.zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--daemon-pid", type=int, required=True)
    args = parser.parse_args()
    return zygote_main(socket.socket(fileno=args.fd), args.daemon_pid)


if __name__ == "__main__":
    sys.exit(_exec_main())
