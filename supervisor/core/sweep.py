"""The limits the daemon enforces on live sessions: the periodic sweep
(memory caps, disk quotas, heartbeats, idleness).  Each turn's timeout is
`supervisor.core.turntimer`'s.

Runs in the daemon's loop.  The decisions are the pure functions of
`supervisor.core.limits` (`memory_verdict`, `settled_figure`, `disk_verdict`,
`heartbeat_overdue`, `idle_expired`); this module
gathers the figures and acts on the verdicts: kills go through
`WorkerOwner.kill`, missed heartbeats through `supervisor.core.silence`
(a remote worker's node host is asked first), hibernation and stops
through the core's callbacks.

What a session costs is read in two halves.  On the loop, each sweep: the
RSS of the worker and every descendant (a pread of a kept-open statm each,
about a microsecond) and the count of its processes.  Off the loop, in the
measuring thread (`supervisor.host.measure`), within a budget a sweep: the PSS
of processes of a session over a limit by RSS, the memfds and shm its
processes hold, its private tmpfs, and its workspace's size.  The loop
plans the reads, the thread makes them, the loop applies what came back
at the next sweep; a session whose figure depends on reads not made yet is
judged by `settled_figure` (never killed on a guess, never let off for
good either).

Where the kernel counts a session's memory (a cgroup with a memory
controller: `Cgroups.memory_bytes`), its figure is the memory figure and
its `memory.max` the cap; none of the reads above are made for it.  What
`ls` shows is that figure or the worker's own RSS, whichever is larger
(the pages a worker shares with the zygote are charged to the zygote).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ipc import messages as m
from ipc.contract import IDLE_HEARTBEAT_FACTOR, ExitReason, LimitKind, figure_past
from supervisor.config import Config
from supervisor.host.diskquota import DISK_EVERY_SECS, DiskWalk
from supervisor.errors import SessiondError
from supervisor.core.events import EventLog
from supervisor.core.limits import (
    CPU_SAMPLE_SECS,
    MIB,
    DiskVerdict,
    PssRead,
    SessionMemory,
    disk_verdict,
    heartbeat_overdue,
    idle_expired,
    memory_verdict,
    patience,
    pss_estimate,
    read_order,
    settled_figure,
)
from supervisor.host.heap import TRIM_EVERY_SECS, give_back_freed
from supervisor.host.proctable import REMOTE_PIDS, ProcTable
from supervisor.host.measure import PROC_READS, Kind, Measurer, Read
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.registry import Registry
from supervisor.core.session import Session, WorkerProc
from supervisor.core.silence import Silence
from supervisor.core.states import State
from supervisor.core.workers import WorkerOwner
from supervisor.core.workspaces import Workspaces

__all__ = ["Sweeper"]

log = logging.getLogger("sessiond.manager")

# A quiet session's memory is read every this many sweeps (see _quiet).
QUIET_EVERY = 10
# Seconds between two readings of a process's open fds, and of a session's
# tmpfs: a listing per process is dearer than a statm pread, and the memory
# found there only grows as fast as a tool writes.
HELD_EVERY_SECS = 1.0
# A process's PSS read is read again after this many sweeps (2 s at the
# default poll), while its session stays over a limit by RSS.
REFRESH_SWEEPS = 20


class Sweeper:
    def __init__(
        self,
        config: Callable[[], Config],
        sessions: Registry,
        events: EventLog,
        workers: WorkerOwner,
        proc_table: ProcTable,
        hibernate: Callable[[Session, str], None],
        stop: Callable[..., Coroutine[Any, Any, None]] | None = None,
        workspaces: Workspaces | None = None,
        *,
        closing: Callable[[], bool],
        metrics: Recorder = NO_METRICS,
        ahead: Callable[[], None] = lambda: None,
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._events = events
        self._workers = workers
        self._proc_table = proc_table
        self._hibernate = hibernate
        # SessionManager.stop: for a limit a restart would not cure (disk).
        self._stop = stop
        self._stopping: set[asyncio.Task[None]] = set()
        self._workspaces = workspaces
        self.quota = workspaces.quota if workspaces is not None else None
        # The daemon is shutting down: the sweep ends (SessionManager's).
        self._closing = closing
        self.metrics = metrics
        # LiveSlots.hibernate_ahead: free live slots kept ahead of demand (sessions gone idle since).
        self._ahead = ahead
        self._trimmed_at = 0.0
        self._tick = 0
        # The loop's stalls seen by the sweep (see run): how many, how long in all.
        self.loop_stalls = 0
        self.loop_stalled_secs = 0.0
        # The measuring thread, one batch at a time (supervisor.host.measure).
        self._measurer = Measurer()
        self._silence = Silence(events, workers, self.metrics)
        self._batch: asyncio.Future[list[Read]] | None = None
        self._plan: list[tuple[Read, SessionMemory]] = []
        self._walks: dict[str, tuple[DiskWalk, SessionMemory]] = {}
        self._planning = False
        self._over = self._over_before = 0  # sessions that asked for PSS reads, this batch and the last
        log.info("disk quota per session (max_disk_mb): %s", self.quota_text())

    def quota_text(self) -> str:
        """How max_disk_mb is enforced here, for the start-up log and `stats`."""
        return self.quota.describe() if self.quota is not None else "not enforced"

    async def run(self) -> None:
        """The periodic sweep, as one task for the daemon's life."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while not self._closing():
            interval = self._config().agent.limits.memory_poll_interval_ms / 1000.0
            next_tick = max(next_tick + interval, loop.time())
            due = time.monotonic() + (next_tick - loop.time())
            await asyncio.sleep(next_tick - loop.time())
            # The loop's own lag: how late this wake-up is.  Past an
            # interval the loop itself was stalled (a blocking call, the
            # daemon stopped or starved), and nothing a worker sent could be
            # read meanwhile: that time is not the workers' silence.
            lag = time.monotonic() - due
            if lag > interval:
                self.excuse_stall(lag)
            try:
                began = time.monotonic()
                self.sweep(began)
                self._submit()
                self.metrics.sweep(time.monotonic() - began)
            except Exception:
                log.exception("supervision sweep failed; carrying on")
        self._measurer.close()
        self._silence.close()

    def excuse_stall(self, lag: float) -> None:
        """The daemon's loop did not run for `lag` seconds: every live
        worker's heartbeat clock is moved on by as much, so that a stall
        of the daemon's own (even a long one) is never blamed on them."""
        self.loop_stalls += 1
        self.loop_stalled_secs += lag
        self.metrics.loop_stall(lag)
        level = logging.WARNING if lag >= 1.0 else logging.DEBUG
        log.log(level, "the daemon's loop was stalled for %.2fs; workers' heartbeat allowances are "
                "extended by as much", lag)
        now = time.monotonic()
        for session in self._sessions.live:
            worker = session.worker
            if worker is not None:
                self._workers.heard_from(worker, min(now, worker.last_heartbeat + lag))

    def sweep(self, now: float) -> None:
        self._tick += 1
        # Plan reads only when the last batch is back (one in flight at a time).
        self._planning = self._batch is None
        self._plan = []
        if self._planning:
            # How many sessions shared the last batch's PSS reads (at least this one's).
            self._over_before, self._over = max(self._over, 1), 0
        # Every QUIET_EVERY-th sweep also drops the workspace walks of
        # sessions gone or on a new worker.  (No /proc file outlives a
        # session's measure: nothing of the ProcTable's to tidy.)
        tidy = self._tick % QUIET_EVERY == 0
        for session in list(self._sessions.live):  # (the sessions at rest have nothing to sweep)
            worker = session.worker
            if worker is None or worker.kill_reason is not None or worker.exited.done():
                continue
            if session.memory.stopping:
                continue
            if not self._quiet(session):
                self._check(session, worker, now)
            elif session.memory.disk_bytes is None:
                self._check_disk(session, worker, now)  # a worker just started: once
        if tidy and self._planning:  # (never a walk the thread may be stepping)
            for sid, (walk, mem) in list(self._walks.items()):
                held = self._sessions.get(sid)
                if held is None or held.memory is not mem:  # removed, or a new worker since
                    walk.close()
                    del self._walks[sid]
        self._events.trim()
        self._ahead()
        if now - self._trimmed_at >= TRIM_EVERY_SECS:
            self._trimmed_at = now
            give_back_freed()  # (what sessions made and hibernated since left in the C heap)

    def _quiet(self, session: Session) -> bool:
        """No turn running and no process of its own seen: nothing in the
        session runs code that could allocate (a handler's background task
        aside) and its worker beats slowly, so it is checked (memory,
        heartbeat, idleness) every QUIET_EVERY-th sweep, its turn spread by
        a per-session offset.  1,000 idle sessions then cost a tenth."""
        if session.current_turn is not None or session.memory.pids:
            return False
        return (self._tick + hash(session.id)) % QUIET_EVERY != 0

    def _check(self, session: Session, worker: WorkerProc, now: float) -> None:
        self._check_memory(session, worker, now)
        if worker.kill_reason is not None:
            return
        if now - session.memory.cpu_at >= CPU_SAMPLE_SECS:
            session.memory.sample_cpu(self._proc_table, now)
        self._check_disk(session, worker, now)
        if session.memory.stopping:
            return
        self._check_liveness(session, worker, now)

    def _check_memory(self, session: Session, worker: WorkerProc, now: float) -> None:
        limits = session.settings.agent.limits
        mem = session.memory
        rss = mem.measure(self._proc_table, worker.pid)
        if self._too_many_processes(session, worker):
            return
        kernel = self._kernel_figure(session)
        if kernel is not None:
            # The kernel's cap holds; its figure is what high is told on.
            # Shown: at least the worker's own RSS.  The kernel charges a
            # page to the cgroup that first touched it, so the pages a
            # worker shares with the zygote it was forked from (its
            # interpreter, the preloaded modules) are the zygote's: the
            # cgroup's count of a fresh 30 MB worker is a few hundred KiB.
            rss = kernel
            mem.rss_bytes = max(kernel, mem.rss_by_pid.get(worker.pid, 0))
        elif worker.pid < REMOTE_PIDS:
            figure = self._local_figure(session, mem, now)
            if figure is None:
                return  # over by RSS, PSS reads still missing: see settled_figure
            rss = figure
        verdict = memory_verdict(rss, limits.max_memory_mb, limits.memory_high_mb, session.memory.high)
        if kernel is not None and verdict.kill:
            return  # memory.max is the kernel's to enforce (and its oom kill, the whole cgroup)
        if verdict.kill:
            self._events.emit_limit(session, LimitKind.MEMORY, rss / MIB, limits.max_memory_mb)
            self._workers.kill(session, worker, ExitReason.KILLED_MEMORY,
                               f"memory cap {limits.max_memory_mb} MiB exceeded at "
                               f"{figure_past(rss / MIB, limits.max_memory_mb)} MiB")
            return
        if verdict.high_crossed:
            assert limits.memory_high_mb is not None
            session.memory.high = True
            self._events.emit_limit(session, LimitKind.MEMORY_HIGH, rss / MIB, limits.memory_high_mb)
            worker.conn.send(m.MemoryHigh(rss_bytes=rss, limit_bytes=limits.memory_high_mb * MIB))
        elif verdict.high_cleared:
            session.memory.high = False

    def _kernel_figure(self, session: Session) -> int | None:
        """The session's memory as its cgroup's memory controller counts it
        (every page charged to it: mapped, memfd, tmpfs), or None where
        there is no such controller for it."""
        cgroups = self._workers.cgroups
        reader = getattr(cgroups, "memory_bytes", None)
        if reader is None:
            return None
        figure = reader(session.id)
        return figure if isinstance(figure, int) else None

    def _local_figure(self, session: Session, mem: SessionMemory, now: float) -> int | None:
        """RSS, or PSS near a limit, plus what no mapping shows; None while
        that cannot be told yet.  Plans the reads that will tell it."""
        limits = session.settings.agent.limits
        cap = limits.max_memory_mb * MIB
        bound = min(limits.max_memory_mb, limits.memory_high_mb or limits.max_memory_mb) * MIB
        if self._planning:
            self._plan_held(session.id, mem, now)
        extra = mem.unmapped()
        if mem.rss_bytes + extra <= bound:
            mem.waited = 0
            mem.rss_bytes += extra
            return mem.rss_bytes
        # Over a limit by RSS: what do the processes' PSS say?
        if self._planning:
            self._over += 1
            for i, pid in enumerate(read_order(mem.rss_by_pid, mem.pss_reads, PROC_READS,
                                               self._tick - REFRESH_SWEEPS)):
                read = Read(Kind.PSS, session.id, pid, rss=mem.rss_by_pid[pid], tick=self._tick, rank=(0.0, i))
                self._plan.append((read, mem))
        estimate = pss_estimate(mem.rss_by_pid, mem.pss_reads)
        # Sessions over a limit share a batch's reads (interleaved: _submit).
        share = max(PROC_READS // max(self._over_before, 1), 1)
        figure = settled_figure(estimate, extra, cap, mem.waited, patience(len(mem.rss_by_pid), share))
        mem.rss_bytes = estimate.total + extra
        if figure is None:
            if self._planning:  # counted in batches: a slow thread does not shorten the wait
                mem.waited += 1
            return None
        mem.waited = 0
        return figure

    def _plan_held(self, sid: str, mem: SessionMemory, now: float) -> None:
        """The fds of processes not listed for HELD_EVERY_SECS, and the
        tmpfs of the sandbox's mount namespace (once a process there is
        known)."""
        held_at = mem.held_at
        due = [pid for pid in mem.rss_by_pid if now - held_at.get(pid, 0.0) >= HELD_EVERY_SECS]
        # No more than a batch can take, the longest unlisted first (never
        # listed: first of all), so that none waits behind the others.
        for i, pid in enumerate(heapq.nsmallest(PROC_READS, due, key=lambda p: held_at.get(p, 0.0))):
            self._plan.append((Read(Kind.FDS, sid, pid, rank=(held_at.get(pid, 0.0), i)), mem))
        if mem.sandbox_pid and now - mem.tmpfs_at >= HELD_EVERY_SECS:
            self._plan.append((Read(Kind.TMPFS, sid, mem.sandbox_pid), mem))

    def _check_disk(self, session: Session, worker: WorkerProc, now: float) -> None:
        """max_disk_mb and max_disk_inodes measured (where the kernel does
        not cap the workspace, and as a backstop where btrfs does; a
        workspace image is a statfs): walk the workspace off the loop,
        every DISK_EVERY_SECS, and stop the session past a cap (a kill
        would restart it into the same full workspace)."""
        limits = session.settings.agent.limits
        mem = session.memory
        if (limits.max_disk_mb is None and limits.max_disk_inodes is None) or self._workspaces is None \
                or worker.pid >= REMOTE_PIDS:
            return
        if not self._planning:
            return  # a batch is out: a walk is stepped by one thread at a time
        walk = self._walks.get(session.id)
        if walk is not None and walk[1] is not mem:
            walk[0].close()  # a walk for a worker since replaced
            walk = None
        if walk is None:
            if mem.disk_bytes is not None and now - mem.disk_at < DISK_EVERY_SECS:
                return
            spaces = self._workspaces
            walk = (DiskWalk(str(spaces.path(session)), subvolumes=spaces.quota.subvolumes,
                             image=spaces.quota.images), mem)
            self._walks[session.id] = walk
        self._plan.append((Read(Kind.DISK, session.id, walk=walk[0]), mem))

    def _disk_stop(self, session: Session, verdict: DiskVerdict) -> None:
        worker = session.worker
        if verdict.kind:
            self._events.emit_limit(session, LimitKind(verdict.kind), verdict.value, verdict.limit)
        session.memory.stopping = True
        if self._stop is not None:
            task = asyncio.get_running_loop().create_task(self._stop_for(session, verdict.detail))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
        elif worker is not None:
            self._workers.kill(session, worker, ExitReason.KILLED_DISK, verdict.detail)

    async def _stop_for(self, session: Session, detail: str) -> None:
        """Stopped, not killed: a kill restarts the worker into the same full
        workspace; a stopped session waits for its user (see README, Limits)."""
        assert self._stop is not None
        try:
            await self._stop(session, detail, exit_reason=ExitReason.KILLED_DISK)
        except SessiondError as exc:
            log.warning("session %s over its disk quota: cannot stop it: %s", session.id, exc.message)

    # ---------------------------------------------------------------- the measuring thread

    def _submit(self) -> None:
        """Hand this sweep's plan to the measuring thread (PSS first: what a
        kill may wait on; then tmpfs, fds and walks)."""
        if not self._planning or not self._plan:
            return
        order = {Kind.PSS: 0, Kind.TMPFS: 1, Kind.FDS: 2, Kind.DISK: 3}
        plan = sorted(self._plan, key=lambda item: (order[item[0].kind], item[0].rank))
        self._plan = plan
        reads = [read for read, _ in plan]
        self._batch = batch = self._measurer.submit(reads)
        batch.add_done_callback(lambda fut: self._apply(plan, fut))

    def _apply(self, plan: list[tuple[Read, SessionMemory]], fut: asyncio.Future[list[Read]]) -> None:
        """On the loop: take in what the thread read, for the sessions
        whose worker is still the one it was read for."""
        self._batch = None
        if fut.cancelled() or fut.exception() is not None:
            if not fut.cancelled():
                log.error("the measuring thread failed: %r", fut.exception())
            return
        now = time.monotonic()
        for read, mem in plan:
            if not read.done:
                continue
            if read.kind is Kind.PSS:
                if read.pid in mem.rss_by_pid:
                    pss = read.pss if read.pss is not None else read.rss
                    mem.pss_reads[read.pid] = PssRead(pss, read.rss, read.tick)
            elif read.kind is Kind.FDS:
                if read.pid in mem.rss_by_pid:
                    mem.held[read.pid] = read.held
                    mem.held_at[read.pid] = now
                    if read.own_fs and not mem.sandbox_pid:
                        mem.sandbox_pid = read.pid
            elif read.kind is Kind.TMPFS:
                mem.tmpfs_bytes, mem.tmpfs_at = read.tmpfs, now
            elif read.walk is not None:
                self._walked(read.session, read.walk, mem, now)

    def _walked(self, sid: str, walk: DiskWalk, mem: SessionMemory, now: float) -> None:
        session = self._sessions.get(sid)
        if session is None or session.memory is not mem or mem.stopping:
            walk.close()
            self._walks.pop(sid, None)
            return
        if walk.done:
            mem.disk_bytes, mem.disk_inodes, mem.disk_at = walk.total, walk.inodes, now
            self._walks.pop(sid, None)
        limits = session.settings.agent.limits
        # A workspace image is capped by the kernel as it was made (a cap
        # lowered since is not, the figures say so: docs/limits.md).
        verdict = None if walk.statfs else disk_verdict(walk.total, walk.inodes, walk.unreadable,
                                                        limits.max_disk_mb, limits.max_disk_inodes)
        if verdict is not None:
            walk.close()
            self._walks.pop(sid, None)
            mem.disk_bytes = max(walk.total, mem.disk_bytes or 0)
            self._disk_stop(session, verdict)

    def _check_liveness(self, session: Session, worker: WorkerProc, now: float) -> None:
        hb = session.settings.agent.worker.heartbeat_interval_secs
        if session.current_turn is None or session.committing == session.current_turn:
            # The worker beats more slowly too once its turn is over, which
            # for it is when it sent Done: a commit waiting on a slow store
            # (a delayed flush, a frozen PostgreSQL) is judged by the
            # worker's pace, not by the store's latency.
            hb *= IDLE_HEARTBEAT_FACTOR
        if heartbeat_overdue(now, worker.last_heartbeat, hb, worker.booted):
            self._silence.overdue(session, worker, now, hb)  # killed, or its node host asked first
            return
        idle_limit = session.settings.agent.session_timeout_secs
        if idle_expired(now, session.last_active, idle_limit, session.state is State.IDLE,
                        session.lock_held):
            self._hibernate(session, f"idle for more than {idle_limit:g}s")

    def _too_many_processes(self, session: Session, worker: WorkerProc) -> bool:
        """max_processes, counted here where the kernel does not count it
        per session (no uid and no user namespace of its own)."""
        limit = session.settings.agent.limits.max_processes
        if limit is None or "rlimit-nproc" in worker.sandbox.get("active", ()):
            return False
        cgroups = self._workers.cgroups
        if cgroups is not None and "pids" in cgroups.controllers:
            return False  # pids.max
        if worker.pid >= REMOTE_PIDS:  # counted on its node (supervisor.cluster.nodehost)
            count = self._proc_table.remote_procs(worker.pid) or 1
        else:
            count = 1 + len(session.memory.pids)
        if count <= limit:
            return False
        self._events.emit_limit(session, LimitKind.PROCESSES, count, limit)
        self._workers.kill(session, worker, ExitReason.KILLED_PROCESSES,
                           f"{count} processes, over max_processes = {limit}")
        return True
