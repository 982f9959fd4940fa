"""The zygote process: a small preloaded process that forks one worker per session.

Why: forking is cheap only from a small process with no threads and no
running event loop, and copy-on-write only pays when the parent's heap stays
still.  The daemon forks the zygote at start-up, before its loop or any
thread exists; the zygote imports the worker side, calls `gc.freeze()` and
from then on does nothing but fork on order and reap.  The daemon's side of
this conversation is `supervisor.spawn.spawner`; they share only `ipc.messages`.

    daemon ──SEQPACKET── zygote ──fork──> worker (own process group)
      │   SpawnWorker  ─►                    │
      │   ◄─ Spawned{pid} + socket + pidfd, Exited{pid, code|signal}
      └────────── socketpair (framed msgpack) ┘

The zygote is the one process that calls waitpid for workers; it reports
every exit status to the daemon, decoded once (code or signal).  It is also
the child subreaper, so tool processes orphaned by a worker re-parent to it
and are reaped instead of haunting init.  After a worker is killed, the
orphans it leaves are killed too, but only its session's: those of its uid
(a root daemon's per-session uid; never a uid another live worker runs
as, such as a shared `worker_user`), its process group or its session id
(each worker leads a session of its own); what bears none of these marks
(a tool that called setsid) is the daemon's to kill, by the session's
cgroup or uid.  PDEATHSIG ties each worker to the zygote (SIGKILL) and the
zygote to the daemon (SIGUSR1: when the daemon dies, the zygote kills
every worker's process group and every process that re-parented to it,
then exits), so nothing outlives the daemon.

A fork refused for want of tasks or memory (EAGAIN at the unit's
`TasksMax`, a `pids.max`, RLIMIT_NPROC or the kernel's table; ENOMEM) is
no reason to die: a spare is simply not made (tried again later, backing
off), and an order is tried again for a while, backing off, then refused
with `SpawnFailed` (the daemon answers the create `capacity`, naming the
ceiling).  Every running worker is untouched: they die only with us.

Each worker runs `[daemon] session_nice` steps nicer than the zygote
(SESSIOND_SESSION_NICE, set by the daemon before it starts us), set here
after fork, before any session code: its tools inherit it.

Started by exec (`python -P -m session_worker.zygote --fd N --daemon-pid P`)
when a zygote must be replaced.  Runs in the zygote process and, after fork,
briefly in each worker (`_worker_child`).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import logging
import os
import select
import selectors
import signal
import socket
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec
import setproctitle

from ipc import logfields
from ipc import messages as m
from ipc import zygote_wire as zw
from ipc.linux import set_child_subreaper, set_dumpable, set_pdeathsig
from session_worker.worker import _reach
from session_worker.errors import ClosedPython
from session_worker.worker._signals import set_signal

__all__ = ["Zygote", "zygote_main"]

_to_zygote = msgspec.msgpack.Decoder(zw.ToZygote)
_encode = msgspec.msgpack.Encoder().encode
_MAX_PACKET = 4096
# After a worker is killed, look for its orphans this long, this often:
# they re-parent one generation at a time as their parents die.
_HUNT_SECS = 1.0
_HUNT_POLL_SECS = 0.02
# A forked worker's first byte to the zygote: it leads its own session now.
_SETSID_DONE = b"\x00"
_SETSID_WAIT_MS = 10_000
# A fork refused for want of tasks or memory: an order is tried again
# after this long, doubling up to the max, and refused once it has waited
# _ORDER_GIVE_UP_SECS; a spare is tried again after the same backoff, up
# to _SPARE_RETRY_MAX_SECS apart.  Other errors (EMFILE) refuse at once.
_FORK_TRANSIENT = frozenset({errno.EAGAIN, errno.ENOMEM})
_FORK_RETRY_SECS = 0.02
_ORDER_RETRY_MAX_SECS = 0.4
_ORDER_GIVE_UP_SECS = 1.5
_SPARE_RETRY_MAX_SECS = 5.0
# How much nicer than the zygote each worker runs (see the module's docstring).
_session_nice = 0
# What a worker imports only when first used (the MCP SDK's client).
_LATE_IMPORTS = ("session_worker.agent._mcpclient",)
# session_worker.worker.main.run_worker, bound by _preload: an import statement
# run in every forked worker is Python work that copies pages.
_run_worker: Callable[..., int]


def _prepare(sock: socket.socket, modules: list[str], expose: bool) -> None:
    """Before the worker side's own preload: the daemon's Python opened to
    the sessions' uids (`_reach`), then the operator's modules imported,
    each checked to have started no thread.  The daemon is told how it went
    (`Preloaded`) when it asked for either, and waits for it at start."""
    error = ""
    try:
        if expose:  # covered by each worker at its boot (_reach: after its workspace is mounted)
            needs = _reach.closed_dirs(sys.path, os.getcwd())
            _reach.check(needs)
            _reach.hold(needs)
            if _reach.closed_itself(os.path.dirname(os.path.dirname(os.path.abspath(_reach.__file__)))):
                # sessiond's own code in a directory closed to others (a
                # checkout in a 0700 directory), which no cover opens: what
                # a worker imports late from it is imported here, for all.
                for name in _LATE_IMPORTS:
                    importlib.import_module(name)
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # SystemExit too: a module's own exit is its failure
                error = f"cannot preload module {name!r}: {type(exc).__name__}: {exc}"
                break
            threads = len(os.listdir("/proc/self/task"))
            if threads > 1:
                error = (f"preloading module {name!r} started {threads - 1} thread(s) in the zygote, which forks "
                         "every worker and must have none: import what starts them in the handler's factory "
                         "instead, or leave the module out of the preload")
                break
    except (ClosedPython, OSError) as exc:
        error = str(exc)
    if expose or modules:
        with contextlib.suppress(OSError):
            sock.send(_encode(zw.Preloaded(error=error)))


def _preload() -> None:
    global _run_worker
    import session_worker.echo  # noqa: F401
    from session_worker.worker.main import run_worker

    _run_worker = run_worker
    with contextlib.suppress(ImportError):
        import session_worker.agent  # noqa: F401


def _configure_logging() -> None:
    """Once, here, for every worker: each worker would otherwise run
    `logging.basicConfig` after its fork, and so copy the pages that code
    touches (see session_worker.worker.main.run_worker).  A no-op when the zygote
    was forked from the daemon (its handler came along); a zygote started
    by exec has none: it logs as the daemon does (ipc.logfields)."""
    fmt = "sessiond-worker[%(process)d]: %(levelname)s: %(message)s"
    if logging.getLogger().handlers or logfields.configure_zygote(fmt):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logfields.TextFormatter(fmt))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)


def zygote_main(sock: socket.socket, daemon_pid: int, preload: list[str] | None = None, expose: bool = False) -> int:
    """Runs in the zygote process until the daemon closes its end or dies.
    `preload`: the operator's modules (supervisor.spawn.preload); `expose`:
    sessions run as uids of their own, which must read our Python (`_reach`)."""
    global _session_nice
    with contextlib.suppress(ValueError):
        _session_nice = max(0, min(19, int(os.environ.pop("SESSIOND_SESSION_NICE", "0"))))
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
    # A zygote started by exec keeps its command line in view: how it was
    # started (python -P: nothing imported from the cwd) is worth seeing.
    started = "session_worker.zygote" in setproctitle.getproctitle()
    title = f"sessiond: zygote ({setproctitle.getproctitle()})" if started else "sessiond: zygote"
    setproctitle.setproctitle(title)
    _configure_logging()
    _prepare(sock, preload or [], expose)
    _preload()
    return Zygote(sock).serve()


class Zygote:
    """The zygote's life after its preload: fork on order (and spares ahead
    of demand), reap every child, report each worker's exit to the daemon,
    hunt a killed worker's strays; at the end, kill everything.

    Single-threaded and without an event loop, so that every fork is safe;
    the signal handlers only set a flag or wake the select (the wakeup fd),
    and all the work happens in `serve`'s loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parent_died = False
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGUSR1, self._on_parent_death)
        sock.setblocking(True)
        # Everything preloaded so far out of the collector's reach: its
        # passes would write to those pages and undo copy-on-write in every
        # worker.  What follows (the zygote's bookkeeping) is not frozen.
        gc.collect()
        gc.freeze()

        self.workers: dict[int, int] = {}  # pid -> token
        # Forked ahead of demand and waiting for Boot: the daemon's end of
        # each, and its pidfd.
        self.spares: dict[int, tuple[socket.socket, int]] = {}
        self.keep_spares = 0
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, "sock")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.my_pid = os.getpid()
        # Until when to hunt strays (see _kill_strays) after a worker was
        # killed, and whose: the dead workers' marks.
        self.hunt_until = 0.0
        self.hunted: list[_Mark] = []
        self.my_uid = os.getuid()
        # Orders a fork was refused for (EAGAIN, ENOMEM), oldest first, and
        # when to try again; when to try a spare again (see _FORK_TRANSIENT).
        self.orders: deque[_Order] = deque()
        self.order_retry_at = self.order_backoff = 0.0
        self.spare_retry_at = self.spare_backoff = 0.0

    def _on_parent_death(self, signum: int, frame: object) -> None:
        self.parent_died = True  # the loop sees it; the wakeup fd wakes the loop

    # ---------------------------------------------------------------- the loop

    def serve(self) -> int:
        """Until the daemon closes its end or dies; then nothing of ours
        outlives it."""
        while not self.parent_died:
            # With spares to make, poll instead of blocking: an order always
            # comes first, a spare is forked only when nothing is waiting.
            hunting = time.monotonic() < self.hunt_until
            events = self.sel.select(self._timeout(hunting))
            if hunting:
                self.reap()
            if not events and self._short():  # asked again: the reap may have lost a spare
                self._fork_spare()
                continue
            daemon_there = self._handle(events)
            self.reap()
            self._serve_orders()
            if not daemon_there:
                break
        self._shut_down()
        return 0

    def _short(self) -> bool:
        """A spare to fork now: fewer than asked, no order waiting, and no
        backoff after a refused fork."""
        return (len(self.spares) < self.keep_spares and not self.orders
                and time.monotonic() >= self.spare_retry_at)

    def _timeout(self, hunting: bool) -> float | None:
        """How long the loop may wait for the daemon: for ever, unless a
        spare, a hunt or a refused fork's retry is due sooner."""
        if self._short():
            return 0
        now = time.monotonic()
        due = [_HUNT_POLL_SECS] if hunting else []
        if self.orders:
            due.append(self.order_retry_at - now)
        elif len(self.spares) < self.keep_spares:
            due.append(self.spare_retry_at - now)
        return max(0.0, min(due)) if due else None

    def _handle(self, events: list[tuple[selectors.SelectorKey, int]]) -> bool:
        """Drain the wakeup fd (then reap) and obey the daemon's order;
        False once the daemon has closed its end."""
        for key, _ in events:
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wake_r, 512)
                self.reap()
                continue
            try:
                data = self.sock.recv(_MAX_PACKET)
            except OSError:
                data = b""
            if not data:
                return False
            match _to_zygote.decode(data):
                case zw.KeepSpares(count=count):
                    self._keep(count)
                case zw.SpawnWorker(token=token):
                    self._spawn(token)
        return True

    def _keep(self, count: int) -> None:
        self.keep_spares = max(0, count)
        while len(self.spares) > self.keep_spares:
            _, (extra, extra_pidfd) = self.spares.popitem()
            extra.close()  # EOF: the spare exits by itself
            os.close(extra_pidfd)

    def _spawn(self, token: int) -> None:
        """A worker for the daemon's order: a spare if one waits, else a
        fresh fork (behind the orders already waiting for one)."""
        if self.spares and not self.orders:
            pid, (ours, pidfd) = self.spares.popitem()
            self._hand_over(token, pid, ours, pidfd)
            return
        self.orders.append(_Order(token, time.monotonic()))
        self._serve_orders()

    def _hand_over(self, token: int, pid: int, ours: socket.socket, pidfd: int) -> None:
        """Its socket and pidfd go to the daemon, none stay here."""
        self.workers[pid] = token
        try:
            socket.send_fds(self.sock, [_encode(zw.Spawned(token=token, pid=pid))],
                            [ours.fileno(), pidfd])
        finally:
            ours.close()
            os.close(pidfd)

    def _serve_orders(self) -> None:
        """Fork for the waiting orders, oldest first, unless a refused fork's
        backoff runs.  At the task or memory ceiling an order waits (the
        reaping of exited workers and tools frees room), and is refused
        after _ORDER_GIVE_UP_SECS; nothing that runs is touched."""
        while self.orders and time.monotonic() >= self.order_retry_at:
            order = self.orders[0]
            try:
                pid, ours, pidfd = self.fork_worker(spare=False)
            except OSError as exc:
                now = time.monotonic()
                if exc.errno not in _FORK_TRANSIENT:
                    self._refuse(self.orders.popleft().token, exc, now - order.since)
                    continue
                while self.orders and now - self.orders[0].since >= _ORDER_GIVE_UP_SECS:
                    gone = self.orders.popleft()
                    self._refuse(gone.token, exc, now - gone.since)
                self.order_backoff = min(max(_FORK_RETRY_SECS, self.order_backoff * 2), _ORDER_RETRY_MAX_SECS)
                self.order_retry_at = now + self.order_backoff
                return
            self.orders.popleft()
            self.order_backoff = 0.0
            self._hand_over(order.token, pid, ours, pidfd)

    def _refuse(self, token: int, exc: OSError, waited: float) -> None:
        code = exc.errno or 0
        why = f"fork: {os.strerror(code) if code else exc}" + (f" (for {waited:.1f}s)" if waited >= 0.01 else "")
        logging.getLogger("sessiond.zygote").warning("no worker for order %d: %s", token, why)
        with contextlib.suppress(OSError):
            self.sock.send(_encode(zw.SpawnFailed(token=token, errno=code, message=why)))

    def _fork_spare(self) -> None:
        """One spare ahead of demand; none while forks are refused (the
        next try backs off, up to _SPARE_RETRY_MAX_SECS)."""
        try:
            pid, ours, pidfd = self.fork_worker(spare=True)
        except OSError as exc:
            if not self.spare_backoff:
                logging.getLogger("sessiond.zygote").warning(
                    "cannot fork a spare worker (%s); trying again later", os.strerror(exc.errno or 0) or exc)
            self.spare_backoff = min(max(_FORK_RETRY_SECS, self.spare_backoff * 2), _SPARE_RETRY_MAX_SECS)
            self.spare_retry_at = time.monotonic() + self.spare_backoff
            return
        self.spare_backoff = 0.0
        self.spares[pid] = (ours, pidfd)

    # ---------------------------------------------------------------- forking

    def fork_worker(self, spare: bool) -> tuple[int, socket.socket, int]:
        """A new worker: (pid, the daemon's end of its socket, its pidfd).
        Raises OSError (EAGAIN, ENOMEM, EMFILE...) with nothing left behind."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            ours.close()
            # fork ignores CLOEXEC: drop the other spares' daemon ends and
            # pidfds, or this worker would keep them open.
            for other, other_pidfd in self.spares.values():
                other.close()
                os.close(other_pidfd)
            _worker_child(theirs.detach(), self.sock, self.wake_r, self.wake_w, self.my_pid, spare)
        # The daemon kills by pidfd, never by pid number.  Opened here, right
        # after fork: only we reap this child, and not before this line, so
        # the number cannot have passed to another process yet.
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            # Not to be handed over without a pidfd: it goes now (our
            # unreaped child: the number is its own; reaped as an orphan).
            os.kill(pid, signal.SIGKILL)
            ours.close()
            theirs.close()
            raise
        theirs.close()
        # The daemon signals a worker's process group through its pidfd:
        # that group must be the worker's own before the daemon hears of it,
        # or the signal would reach ours.  The child makes it (a session of
        # its own, which setpgid from here would forbid) and says so.
        poll = select.poll()
        poll.register(ours, select.POLLIN)
        if not (poll.poll(_SETSID_WAIT_MS) and ours.recv(1) == _SETSID_DONE):
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)  # dead or stuck before setsid: a group of its own at least
        return pid, ours, pidfd

    # ---------------------------------------------------------------- reaping

    def reap(self) -> None:
        """Every child that exited, then the hunt for a killed worker's strays."""
        self._reap_exits()
        self._hunt()

    def _reap_exits(self) -> None:
        for pid, code, uid in _reap_any():
            spare = self.spares.pop(pid, None)
            if spare is not None:
                spare[0].close()  # a spare that died unused: nobody to tell
                os.close(spare[1])
                continue
            if self.workers.pop(pid, None) is None:
                continue  # an orphaned tool process we adopted as subreaper
            exited = zw.Exited(pid=pid, code=code) if code >= 0 else zw.Exited(pid=pid, signal=-code)
            with contextlib.suppress(OSError):
                self.sock.send(_encode(exited))
            if code < 0:
                self.hunt_until = time.monotonic() + _HUNT_SECS
                # A uid of its own (a root daemon's session uid) marks the
                # session's processes; one another worker runs as too (the
                # zygote's own, a shared worker_user) marks nobody's.
                own = uid != self.my_uid and not any(_identity(w)[2] == uid for w in self.workers)
                self.hunted.append(_Mark(pid, uid if own else None))

    def _hunt(self) -> None:
        if time.monotonic() < self.hunt_until:
            _kill_strays(self.workers.keys() | self.spares.keys(), self.hunted)
        elif self.hunted:
            self.hunted.clear()

    def _shut_down(self) -> None:
        signal.set_wakeup_fd(-1)
        for spare, spare_pidfd in self.spares.values():
            spare.close()
            os.close(spare_pidfd)
        _kill_everything({**self.workers, **dict.fromkeys(self.spares, 0)})


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


class _Order(NamedTuple):
    """A worker the daemon ordered and no fork has answered yet."""

    token: int
    since: float  # time.monotonic() of the order


class _Mark(NamedTuple):
    """What marks a killed worker's processes: its process group and
    session (both its pid) and, when it had one of its own, its uid."""

    pid: int
    uid: int | None


def _kill_strays(ours: set[int], dead: list[_Mark]) -> None:
    """SIGKILL every child that is not a worker and bears the mark of a
    killed worker: another session's orphans are not this death's business.

    Called for a while after a worker was killed (by us, the daemon or the
    kernel): its tool host dies with it (PDEATHSIG), and whatever the tools
    left re-parents to us, the subreaper.  A worker that exits by itself has
    stopped its host tidily, and the daemon's stop gives the rest their
    grace period."""
    uids = {d.uid for d in dead if d.uid is not None}
    pids = {d.pid for d in dead}
    for pid in _my_children():
        if pid in ours:
            continue
        pgid, sid, uid = _identity(pid)
        if pgid in pids or sid in pids or uid in uids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # our unreaped child: the number is its own


def _identity(pid: int) -> tuple[int | None, int | None, int | None]:
    """A process's (process group, session, real uid), from /proc; None
    where unread."""
    pgid = sid = uid = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        pgid, sid = int(fields[2]), int(fields[3])
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    uid = int(line.split()[1])
                    break
    return pgid, sid, uid


def _reap_any() -> Iterator[tuple[int, int, int]]:
    """(pid, exit code or -signal, real uid) of every child that has exited,
    without blocking: waitid reports the uid a worker ran as, gone from
    /proc once it is reaped."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            return
        if info is None or info.si_pid == 0:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        yield info.si_pid, code, info.si_uid


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
        set_signal(signal.SIGCHLD, signal.SIG_DFL)
        set_signal(signal.SIGTERM, signal.SIG_DFL)
        set_signal(signal.SIGUSR1, signal.SIG_DFL)
        os.close(wake_r)
        os.close(wake_w)
        zsock.close()
        # A session of its own: its id marks the worker's processes (its
        # tools keep it unless they call setsid) for the hunt after its death.
        try:
            os.setsid()
            os.write(fd, _SETSID_DONE)
        except OSError:
            # The zygote gave up waiting and made us a group leader; the
            # daemon may hear from us already: no byte of ours for it.
            os.setpgid(0, 0)
        if _session_nice:
            with contextlib.suppress(OSError):
                os.nice(_session_nice)  # before any session code; its tools inherit it
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != zygote_pid:
            os._exit(1)
        code = _run_worker(socket.socket(fileno=fd), warm_up=spare)
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
