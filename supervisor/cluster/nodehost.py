"""The node host: the one Ray actor per machine that runs our workers there.

Cluster mode (`[cluster] backend = "ray"`) puts sessions' workers on other
machines without a Ray actor per session (one costs ~40 MiB; a worker ~4
MiB).  Each machine gets one node host, a detached, named async actor
pinned to its node.  It starts a zygote by exec (`python -P -m
session_worker.zygote`, as `ZygoteSpawner` restarts one): never by fork, as
a Ray actor process has threads.  From there everything is what one machine
does: the zygote forks workers, reaps them, and reports exits; the node
host holds each worker's pidfd and signals its process group through it,
and measures each worker's tree (RSS of it and its descendants, with
pidfds for those that leave its group) as the daemon's sweep does on one
machine.  The figures go to the front, whose sweep decides on caps.

What crosses machines is Ray's only, never a socket protocol of ours:

    front (RaySpawner)                       node host (this actor)
      spawn()           ── actor call ──►    zygote forks a worker
      send(pid, bytes)  ── actor call ──►    written to the worker's socket
      frames(pid)       ◄─ streaming ───     bytes the worker wrote, ("rss", n, procs)
                           generator         when its tree's memory changes, then
                                             ("exit", code, signal, detail) and
                                             ("gone",) once nothing of it is left
      signal / kill_tree ─ actor call ──►    pidfd_send_signal on the node
      silent_for(pid)   ── actor call ──►    how long since the worker last wrote (the
                                             share it could run, if starved of CPU)
      set_draining(flag) ─ actor call ──►    spawn answers "draining" meanwhile

The bytes are the worker protocol's frames, uninterpreted here: the front
frames and checks them as it does a local worker's.  Nothing of a session
runs on without a front to answer to: each front renews a lease here (Ray
does not cancel a dead caller's streaming call), and the workers of a
front whose lease ran out are killed, as are those whose stream ends early.

Runs in the node host's actor process, in the actor's one event-loop thread
(the zygote is tied to that thread by PDEATHSIG, which is per thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import time
from collections.abc import AsyncIterator
from typing import TypeGuard

from supervisor.core.limits import SessionMemory, own_silence
from supervisor.host.proctable import ProcTable
from supervisor.host.schedstat import waiting_share
from supervisor.spawn.spawner import ZygoteSpawner

__all__ = ["ExitItem", "Frame", "NodeHost", "checked_exit", "checked_silence", "checked_usage", "read_more",
           "recv_batch"]

log = logging.getLogger("sessiond.nodehost")

_SIGKILL = signal.SIGKILL
_READ_BYTES = 1 << 16
# The most bytes one Ray call or stream item carries: frames that are ready
# together cross together (each Ray call or item costs ~1.5 ms here,
# whatever it carries), up to this.
BATCH_BYTES = 1 << 20
# How often to look whether an exited worker's process group is empty.
_GONE_POLL_SECS = 0.05
# How often each worker's tree is measured, and by how much its RSS must
# change to be reported to the front (each report is a stream item).
_MEASURE_SECS = 0.1
_REPORT_STEP_BYTES = 1 << 20
# How often fronts' leases are checked.
_LEASE_CHECK_SECS = 0.5

# What `frames` yields: a chunk of the worker's bytes, ("rss", bytes,
# processes) of its tree, its exit ("exit", code, signal, detail), then
# ("gone",).
ExitItem = tuple[str, int | None, int | None, str]
Frame = bytes | ExitItem | tuple[str, int, int] | tuple[str]


class _Worker:
    __slots__ = ("claimed", "doomed", "exit", "front", "heard", "memory", "sock")

    def __init__(self, sock: socket.socket, exit: asyncio.Future[tuple[int | None, int | None, str]],
                 front: str, claimed: bool) -> None:
        self.sock = sock
        self.exit = exit
        self.front = front  # the front that holds it (by its lease)
        # False for a spare (supervisor.cluster.ray_spares) until its front claims it;
        # doomed: a spare killed here (its exit may not have come yet).
        self.claimed = claimed
        self.doomed = False
        self.heard = time.monotonic()  # when its last bytes were read here
        # Its descendants as measured here, and pidfds for those that left
        # its process group: a kill reaches them through these.
        self.memory = SessionMemory()


class NodeHost:
    """One per machine; its methods are Ray actor calls from fronts."""

    def __init__(self) -> None:
        self._spawner: ZygoteSpawner | None = None
        self._workers: dict[int, _Worker] = {}
        self._procs = ProcTable()
        self._leases: dict[str, float] = {}  # front -> time.monotonic() its lease ends
        self._watchdog: asyncio.Task[None] | None = None
        # Exits that came before the spawn call registered the worker.
        self._exits: dict[int, asyncio.Future[tuple[int | None, int | None, str]]] = {}
        # Drained by an operator: no new worker here (the fronts place
        # elsewhere); the workers here run on until their fronts move them.
        self._draining = False

    def _zygote(self) -> ZygoteSpawner:
        if self._spawner is None:
            spawner = ZygoteSpawner(on_exit=lambda pid, code, sig: self._exited(pid, code, sig, ""),
                                    on_zygote_lost=self._zygote_lost)
            spawner.start_by_exec()
            spawner.attach(asyncio.get_running_loop())
            self._spawner = spawner
        return self._spawner

    def _exit_future(self, pid: int) -> asyncio.Future[tuple[int | None, int | None, str]]:
        fut = self._exits.get(pid)
        if fut is None:
            fut = self._exits[pid] = asyncio.get_running_loop().create_future()
        return fut

    def _exited(self, pid: int, code: int | None, sig: int | None, detail: str) -> None:
        fut = self._exit_future(pid)
        if not fut.done():
            fut.set_result((code, sig, detail))

    def _zygote_lost(self) -> None:
        # Its workers died with it (PDEATHSIG), unreported: say so for each.
        for pid in list(self._workers):
            self._exited(pid, None, _SIGKILL, "the zygote on its node died")

    async def spawn(self, front: str, lease_secs: float, spare: bool = False) -> int | str:
        """A new worker for `front`, which holds it by a lease; its pid on
        this node, or "draining" (supervisor.cluster.ray_spawner.DRAINING).  A
        `spare` waits to be claimed (`claim`).  Raises SpawnerDied (the
        zygote died and is being restarted): the caller gets it wrapped."""
        if not isinstance(front, str) or not front or len(front) > 64:
            raise ValueError("a front names itself")
        if self._draining:
            return "draining"
        await self.lease(front, lease_secs)
        spawner = self._zygote()
        pid, sock = await spawner.request()
        sock.setblocking(False)
        self._workers[pid] = _Worker(sock, self._exit_future(pid), front, claimed=spare is not True)
        return pid

    async def claim(self, pid: int) -> bool:
        """A spare is about to get its session: True, unless this node is
        draining (the spare is killed, and its front places elsewhere) or
        the spare is gone.  Asked here, where the mark is, so no front
        hands out a spare on a node another front just marked."""
        worker = self._workers.get(pid)
        if worker is None or worker.exit.done() or worker.doomed:
            return False
        if self._draining:
            self._kill_spare(pid, worker)
            return False
        worker.claimed = True
        return True

    async def drop_spare(self) -> bool:
        """A front has no free slot for a session: kill one spare here (of
        any front), whose slot it then gets.  False if there is none."""
        for pid, worker in self._workers.items():
            if not worker.claimed and not worker.doomed and not worker.exit.done():
                self._kill_spare(pid, worker)
                return True
        return False

    def _kill_spare(self, pid: int, worker: _Worker) -> None:
        worker.doomed = True
        if self._spawner is not None and not worker.exit.done():
            self._spawner.kill_tree(pid, worker.memory.escapees())

    async def lease(self, front: str, secs: float) -> None:
        """`front` is alive for `secs` more: its workers stay.  A front
        that stops renewing (it died, or cannot reach us) loses its
        workers when its lease runs out; Ray would not tell us."""
        if isinstance(front, str) and isinstance(secs, (int, float)) and not isinstance(secs, bool):
            self._leases[front] = time.monotonic() + min(max(float(secs), 1.0), 600.0)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_leases())

    async def _watch_leases(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(_LEASE_CHECK_SECS)
            now = time.monotonic()
            stalled = now - last - _LEASE_CHECK_SECS
            last = now
            if stalled > _LEASE_CHECK_SECS:
                # Our own loop was held up (a busy node): renewals sent
                # meanwhile are still queued behind us.  The stall is ours,
                # never a front's: it does not count against any lease.
                for front in self._leases:
                    self._leases[front] += stalled
                continue
            for pid, worker in list(self._workers.items()):
                if self._leases.get(worker.front, 0.0) < now and not worker.exit.done():
                    log.warning("worker %d: its front %s stopped renewing its lease; killing it",
                                pid, worker.front)
                    if self._spawner is not None:
                        self._spawner.kill_tree(pid, worker.memory.escapees())
            for front in [f for f, until in self._leases.items() if until < now - 600]:
                del self._leases[front]

    async def send(self, pid: int, data: bytes) -> bool:
        """Write the front's bytes to the worker; False once it cannot take them."""
        worker = self._workers.get(pid)
        if worker is None or not isinstance(data, bytes):
            return False
        try:
            await asyncio.get_running_loop().sock_sendall(worker.sock, data)
        except OSError:
            return False
        return True

    async def frames(self, pid: int) -> AsyncIterator[Frame]:
        """The worker's bytes as it writes them, its tree's RSS when that
        changes, then its exit, then ("gone",) once nothing of it is left."""
        worker = self._workers.get(pid)
        if worker is None:
            yield ("exit", None, None, f"no worker {pid} on this node")
            yield ("gone",)
            return
        out: asyncio.Queue[Frame] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(self._read(pid, worker, out)),
                 loop.create_task(self._measure(pid, worker, out))]
        finished = False
        held: Frame | None = None  # taken from the queue behind a batch of bytes
        try:
            while True:
                item = held if held is not None else await out.get()
                held = None
                if isinstance(item, bytes):
                    # Whatever else the worker wrote meanwhile goes in the same item.
                    parts = [item]
                    size = len(item)
                    while size < BATCH_BYTES and not out.empty():
                        more = out.get_nowait()
                        if not isinstance(more, bytes):
                            held = more
                            break
                        parts.append(more)
                        size += len(more)
                    if len(parts) > 1:
                        item = b"".join(parts)
                yield item
                if item == ("gone",):
                    finished = True
                    return
        finally:
            for task in tasks:
                task.cancel()
            if not finished and self._spawner is not None:
                self._spawner.kill_tree(pid, worker.memory.escapees())  # abandoned by its front
            worker.sock.close()
            worker.memory.close()  # (the table holds nothing between measures)
            self._workers.pop(pid, None)
            self._exits.pop(pid, None)

    async def _read(self, pid: int, worker: _Worker, out: asyncio.Queue[Frame]) -> None:
        while data := await recv_batch(worker.sock):
            worker.heard = time.monotonic()
            out.put_nowait(data)
        code, sig, detail = await worker.exit
        out.put_nowait(("exit", code, sig, detail))
        while self._spawner is not None and self._spawner.tree_alive(pid, worker.memory.escapees()):
            await asyncio.sleep(_GONE_POLL_SECS)
        out.put_nowait(("gone",))

    async def _measure(self, pid: int, worker: _Worker, out: asyncio.Queue[Frame]) -> None:
        """The sweep's measure, done where the processes are; the front
        decides what a figure means (caps are per session, and reloadable)."""
        last, last_count = -1, -1
        while not worker.exit.done():
            rss = worker.memory.measure(self._procs, pid)
            count = 1 + len(worker.memory.pids)  # for max_processes, where the kernel does not count it
            if abs(rss - last) >= _REPORT_STEP_BYTES or count != last_count:
                out.put_nowait(("rss", rss, count))
                last, last_count = rss, count
            await asyncio.sleep(_MEASURE_SECS)

    async def signal(self, pid: int, sig: int) -> None:
        if self._spawner is not None and pid in self._workers and isinstance(sig, int):
            with contextlib.suppress(ValueError, OSError):
                self._spawner.signal(pid, sig)

    async def kill_tree(self, pid: int, sig: int = _SIGKILL) -> None:
        if self._spawner is not None and pid in self._workers and isinstance(sig, int):
            with contextlib.suppress(ValueError, OSError):
                self._spawner.kill_tree(pid, self._workers[pid].memory.escapees(), sig)

    async def silent_for(self, pid: int) -> float | None:
        """How long this host has had nothing from the worker, in seconds,
        as the worker's own (a front asks before it blames the worker for
        missed heartbeats: supervisor.core.silence); 0 when bytes wait in
        its socket (our loop was held up, not the worker); None once it is
        gone.  A worker this machine starves of CPU is silent only for the
        share it could run (`own_silence`, as on the front's machine)."""
        worker = self._workers.get(pid)
        if worker is None or worker.exit.done():
            return None
        if _bytes_wait(worker.sock):
            return 0.0
        # None waiting: the loop may have taken them in this pass (sock_recv's
        # callback) and not yet woken `_read`, which marks the worker heard;
        # so a host let go after a stall saw `heard` from before it.  The
        # loop turns (once, and through the probe) before `heard` is read.
        await asyncio.sleep(0)
        waiting = await waiting_share(pid)
        if worker.exit.done():
            return None
        return 0.0 if _bytes_wait(worker.sock) else own_silence(time.monotonic() - worker.heard, waiting)

    async def set_draining(self, flag: bool) -> None:
        """Mark the node (or no longer).  Spares of any front here are
        killed at once: their slots are for the nodes still in use."""
        self._draining = flag is True
        if self._draining:
            for pid, worker in list(self._workers.items()):
                if not worker.claimed:
                    self._kill_spare(pid, worker)

    async def draining(self) -> bool:
        return self._draining

    async def workers(self) -> list[int]:
        return list(self._workers)

    async def close(self) -> None:
        """Stop the zygote (it kills its workers) and forget everything."""
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        for pid in list(self._workers):
            self._exited(pid, None, _SIGKILL, "its node host was closed")


def _bytes_wait(sock: socket.socket) -> bool:
    """Whether bytes wait in the (non-blocking) socket."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:  # nothing waiting (or the socket broke: its exit is coming)
        return False


async def recv_batch(sock: socket.socket) -> bytes:
    """The next bytes of a (non-blocking) socket with all it holds already
    (`read_more`); b"" at EOF or on an error."""
    try:
        data = await asyncio.get_running_loop().sock_recv(sock, _READ_BYTES)
    except OSError:
        return b""
    return read_more(sock, data) if data else b""


def read_more(sock: socket.socket, data: bytes, limit: int = BATCH_BYTES) -> bytes:
    """`data` and whatever else the (non-blocking) socket holds already, up
    to `limit` bytes: frames written together cross in one Ray call or
    stream item.  An error or EOF is left for the next read to find."""
    parts = [data]
    size = len(data)
    while size < limit:
        try:
            more = sock.recv(min(_READ_BYTES, limit - size))
        except (BlockingIOError, InterruptedError):
            break
        except OSError:
            break
        if not more:
            break  # EOF: the next recv returns it again
        parts.append(more)
        size += len(more)
    return parts[0] if len(parts) == 1 else b"".join(parts)


# What a front checks of each stream item (it trusts no value from a node).

def checked_usage(item: object) -> tuple[int, int] | None:
    """("rss", bytes, processes) from a node host, or None if it is not one."""
    if isinstance(item, tuple) and len(item) == 3 and item[0] == "rss":
        _, rss, procs = item
        if (_plain_int(rss) and 0 <= rss < 1 << 50 and _plain_int(procs) and 1 <= procs < 1 << 22):
            return rss, procs
    return None


def checked_silence(answer: object) -> float | None:
    """A node host's `silent_for` answer: seconds, or None (the worker is
    gone there); inf when it is neither (the front's own figure stands)."""
    if answer is None:
        return None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and 0 <= answer < math.inf:
        return float(answer)
    return math.inf


def _plain_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_exit(item: object) -> tuple[int | None, int | None, str] | None:
    """("exit", code, signal, detail) from a node host, or None if it is not one."""
    if not (isinstance(item, tuple) and len(item) == 4 and item[0] == "exit"):
        return None
    _, code, sig, detail = item
    for value in (code, sig):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not -(1 << 31) <= value < 1 << 31):
            return None
    if not isinstance(detail, str):
        return None
    return code, sig, detail[:500]
