"""The limits the daemon enforces on live sessions: the periodic sweep
(memory caps, heartbeats, idleness) and each turn's timeout.

Runs in the daemon's loop.  The decisions are the pure functions of
`supervisor.limits` (`memory_verdict`, `heartbeat_overdue`, `idle_expired`,
`turn_deadline_left`); this module reads the figures and acts on the
verdicts: kills go through `WorkerOwner.kill`, hibernation through the
core's callback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from ipc import messages as m
from ipc.contract import IDLE_HEARTBEAT_FACTOR, ExitReason, LimitKind
from supervisor.config import Config
from supervisor.events import EventLog
from supervisor.limits import (
    HEARTBEATS_MISSED,
    MIB,
    REMOTE_PIDS,
    ProcTable,
    heartbeat_overdue,
    idle_expired,
    memory_verdict,
    turn_deadline_left,
)
from supervisor.metrics import NO_METRICS, Recorder
from supervisor.session import Session, WorkerProc
from supervisor.states import State, Trigger
from supervisor.workers import WorkerOwner

__all__ = ["Sweeper"]

log = logging.getLogger("sessiond.manager")

# A quiet session's memory is read every this many sweeps (see _quiet).
QUIET_EVERY = 10


class Sweeper:
    def __init__(
        self,
        config: Callable[[], Config],
        sessions: Mapping[str, Session],
        events: EventLog,
        workers: WorkerOwner,
        proc_table: ProcTable,
        hibernate: Callable[[Session, str], None],
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._events = events
        self._workers = workers
        self._proc_table = proc_table
        self._hibernate = hibernate
        self.closing = False
        self.metrics: Recorder = NO_METRICS
        self._tick = 0

    async def run(self) -> None:
        """The periodic sweep, as one task for the daemon's life."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while not self.closing:
            interval = self._config().agent.limits.memory_poll_interval_ms / 1000.0
            next_tick = max(next_tick + interval, loop.time())
            await asyncio.sleep(next_tick - loop.time())
            try:
                began = time.monotonic()
                self.sweep(began)
                self.metrics.sweep(time.monotonic() - began)
            except Exception:
                log.exception("supervision sweep failed; carrying on")

    def sweep(self, now: float) -> None:
        self._tick += 1
        # Every QUIET_EVERY-th sweep also closes the /proc files of
        # processes no session holds any more, so it must see them all.
        tidy = self._tick % QUIET_EVERY == 0
        seen: set[int] = set()
        for session in list(self._sessions.values()):
            worker = session.worker
            if worker is None or worker.kill_reason is not None or worker.exited.done():
                continue
            if not self._quiet(session):
                self._check(session, worker, now)
            if tidy:
                seen.add(worker.pid)
                seen.update(session.memory.pids)
        if tidy:
            self._proc_table.keep_only(seen)
        self._events.trim()

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
        self._check_memory(session, worker)
        if worker.kill_reason is not None:
            return
        self._check_liveness(session, worker, now)

    def _check_memory(self, session: Session, worker: WorkerProc) -> None:
        limits = session.settings.agent.limits
        rss = session.memory.measure(self._proc_table, worker.pid)
        bound = min(limits.max_memory_mb, limits.memory_high_mb or limits.max_memory_mb) * MIB
        if rss > bound:
            rss = session.memory.measure_pss(self._proc_table, worker.pid)
        if self._too_many_processes(session, worker):
            return
        verdict = memory_verdict(rss, limits.max_memory_mb, limits.memory_high_mb, session.memory.high)
        if verdict.kill:
            self._events.emit_limit(session, LimitKind.MEMORY, rss / MIB, limits.max_memory_mb)
            self._workers.kill(session, worker, ExitReason.KILLED_MEMORY,
                               f"memory cap {limits.max_memory_mb} MiB exceeded at {rss / MIB:.0f} MiB")
            return
        if verdict.high_crossed:
            assert limits.memory_high_mb is not None
            session.memory.high = True
            self._events.emit_limit(session, LimitKind.MEMORY_HIGH, rss / MIB, limits.memory_high_mb)
            worker.conn.send(m.MemoryHigh(rss_bytes=rss, limit_bytes=limits.memory_high_mb * MIB))
        elif verdict.high_cleared:
            session.memory.high = False

    def _check_liveness(self, session: Session, worker: WorkerProc, now: float) -> None:
        hb = session.settings.agent.worker.heartbeat_interval_secs
        if session.current_turn is None:
            hb *= IDLE_HEARTBEAT_FACTOR  # the worker beats more slowly too
        if heartbeat_overdue(now, worker.last_heartbeat, hb, worker.booted):
            silent = now - worker.last_heartbeat
            self._events.emit_limit(session, LimitKind.HEARTBEAT, silent, HEARTBEATS_MISSED * hb)
            self._workers.kill(session, worker, ExitReason.KILLED_HEARTBEAT,
                               f"no heartbeat for {silent:.1f}s (interval {hb:g}s): its event loop is stuck")
            return
        idle_limit = session.settings.agent.session_timeout_secs
        if idle_expired(now, session.last_active, idle_limit, session.state is State.IDLE,
                        session.lock.locked()):
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
        if worker.pid >= REMOTE_PIDS:  # counted on its node (supervisor.nodehost)
            count = self._proc_table.remote_procs(worker.pid) or 1
        else:
            count = 1 + len(session.memory.pids)
        if count <= limit:
            return False
        self._events.emit_limit(session, LimitKind.PROCESSES, count, limit)
        self._workers.kill(session, worker, ExitReason.KILLED_PROCESSES,
                           f"{count} processes, over max_processes = {limit}")
        return True

    # ---------------------------------------------------------------- turn timeouts

    def arm_turn_timer(self, session: Session, turn: int) -> None:
        if session.worker is not None:
            # The worker goes to the full pace on its input (its next beat
            # one interval after it); the shorter allowance counts from now.
            session.worker.last_heartbeat = time.monotonic()
        session.turn_timer = asyncio.get_running_loop().call_later(
            session.settings.agent.turn_timeout_secs, self._on_turn_timeout, session, turn
        )

    def retime_turn(self, session: Session) -> None:
        """A running turn under a changed turn_timeout_secs: its deadline is
        counted from its start, and one already past fires now."""
        if session.turn_timer is None or session.current_turn is None:
            return
        session.turn_timer.cancel()
        left = turn_deadline_left(time.monotonic(), session.turn_started,
                                  session.settings.agent.turn_timeout_secs)
        session.turn_timer = asyncio.get_running_loop().call_later(
            left, self._on_turn_timeout, session, session.current_turn
        )

    def _on_turn_timeout(self, session: Session, turn: int) -> None:
        """Interrupt first; kill if the handler ignores it for stop_grace_secs."""
        session.turn_timer = None
        worker = session.worker
        if session.current_turn != turn or worker is None:
            return
        timeout = session.settings.agent.turn_timeout_secs
        grace = self._config().daemon.stop_grace_secs
        self._events.emit_limit(session, LimitKind.TURN_TIMEOUT, time.monotonic() - session.turn_started, timeout)
        if session.state is State.RUNNING:
            self._events.set_state(session, Trigger.INTERRUPT, reason=f"turn_timeout_secs={timeout:g} reached")
        worker.conn.send(m.InterruptTurn(turn=turn))
        session.kill_timer = asyncio.get_running_loop().call_later(
            grace, self._on_turn_kill, session, worker, turn, timeout, grace
        )

    def _on_turn_kill(self, session: Session, worker: WorkerProc, turn: int, timeout: float, grace: float) -> None:
        session.kill_timer = None
        if session.current_turn != turn or session.worker is not worker:
            return
        self._workers.kill(session, worker, ExitReason.KILLED_TURN_TIMEOUT,
                           f"turn {turn} still running {grace:g}s after its timeout of {timeout:g}s")
