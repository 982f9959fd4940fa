"""Each session's worker, from spawn to exit: boot, its own messages,
kills, exits and restarts (what it says in a turn: supervisor.core.turnmessages).

Runs in the daemon's loop.  Gunicorn's arbiter is the model: one owner for
a worker's life.  Workers are started through the `Spawner` seam (today the
zygote, `supervisor.spawn.spawner`), killed through one path (`kill`, which
records why, so the exit is classified once into an `ExitReason`), stopped
trio-style (`terminate`: ask, wait, then kill) and restarted by the pure
`RestartPolicy` with backoff, until the restart intensity says `failed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec

from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.contract import NODE_LOST_PREFIX, ExitReason, LimitKind
from ipc.errors import ProtocolError
from ipc.settings import SessionSettings
from supervisor.spawn.cgroups import Cgroups
from supervisor.config import Config
from supervisor.errors import Capacity, Conflict, Internal, SessiondError
from supervisor.core.events import EventLog
from supervisor.core.exits import classify, describe_exit
from supervisor.core.ledger import TurnLedger
from supervisor.core.resumable import ResumableTurns
from supervisor.core.turnmessages import TurnMessages
from supervisor.core.containment import Containment
from supervisor.core.limits import SessionMemory
from supervisor.host.proctable import ProcTable
from supervisor.logtag import tagged
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.registry import Registry
from supervisor.spawn.seams import LosesWorkers, Pending, Spawner, SpawnerDied, drop_pending
from supervisor.core.session import Session, WorkerProc
from supervisor.store.state_store import Fenced, StoreDamaged, StoreError
from supervisor.core.fdbudget import out_of_fds
from supervisor.core.states import LIVE, RestartPolicy, State, Trigger
from supervisor.core.workspaces import Workspaces

__all__ = ["WorkerOwner"]

log = logging.getLogger("sessiond.manager")

_worker_decoder = msgspec.msgpack.Decoder(m.FromWorker)
_settings_encoder = msgspec.msgpack.Encoder()
_WORKER_FRAME_LIMIT = 1 << 30

class WorkerOwner:
    def __init__(
        self,
        config: Callable[[], Config],
        spawner: Spawner,
        events: EventLog,
        ledger: TurnLedger,
        resumable: ResumableTurns,
        messages: TurnMessages,
        proc_table: ProcTable,
        workspaces: Workspaces,
        spawn_task: Callable[[Coroutine[Any, Any, None]], None],
        *,
        closing: Callable[[], bool],
        make_room: Callable[[Session], Awaitable[None]], sessions: Registry,
        claim: Callable[[Session], Awaitable[None]] | None = None,
        damaged: Callable[[Session, StoreDamaged], SessiondError] | None = None,
        sandbox: m.SandboxBoot | None = None,
        cgroups: Cgroups | None = None,
        metrics: Recorder = NO_METRICS,
    ) -> None:
        self._config = config
        self.spawner = spawner
        self._events = events
        self._ledger = ledger
        self._resumable = resumable  # the turn its worker died in, held open and resumed
        self._messages = messages  # what a worker says in a turn
        self._proc_table = proc_table
        self._workspaces = workspaces
        self._spawn_task = spawn_task
        self.by_pid: dict[int, Session] = {}
        # The daemon is shutting down: nothing is restarted (SessionManager's).
        self._closing = closing
        # What the daemon found at start for confining tools (None: off).
        self.sandbox = sandbox
        # A cgroup per session (supervisor.spawn.cgroups), where the kernel offers one.
        self.cgroups = cgroups
        # The cgroups' and shares' side of a worker's life, OOMs told by their ceiling.
        self.containment = Containment(config, cgroups, workspaces, events, self.kill,
                                       lambda: self.by_pid.values())
        self.metrics = metrics
        # LiveSlots.make_room: a live worker's room, hibernating others for it.
        self._make_room = make_room
        self._sessions = sessions  # told when a worker comes or goes (Registry.relive: the live slots)
        # Takes a session held by another daemon back first (supervisor.core.fencing).
        self._claim = claim
        # Damage.at_boot: a boot's read found the log damaged (supervisor.core.damage).
        self._damaged = damaged
        # The spawner was built before any of the core (the zygote is forked
        # before the loop exists), so its exit reports are routed here, by
        # their owner, once: the one late connection left (ARCHITECTURE.md).
        # Through the pacer, like the workers' messages: an exit reported
        # after a worker's last message is handled after it.
        spawner.on_exit = lambda pid, code, sig: ledger.pacer.now_or_later(self.on_exit, pid, code, sig)
        spawner.on_zygote_lost = self.on_spawner_lost
        if isinstance(spawner, LosesWorkers):
            # Cluster mode: a worker lost with its node is a crash that names the node.
            spawner.on_worker_lost = lambda pid, why: self.on_exit(pid, None, signal.SIGKILL, detail=why)

    async def claim(self, session: Session) -> None:
        """Take the session back if another daemon holds it (no-op alone)."""
        if self._claim is not None:
            await self._claim(session)

    # ---------------------------------------------------------------- start

    async def start(
        self,
        session: Session,
        pending: Pending | None = None,
        during_boot: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        """Spawn (or take the worker already ordered), boot and wait for
        Ready; `during_boot` runs while the worker boots.  Caller holds
        session.locked() and has put the session in STARTING."""
        assert session.state is State.STARTING, session.state
        loop = asyncio.get_running_loop()
        try:
            await self.claim(session)
            await self._make_room(session)
            self.containment.check_room(session)  # its owner's share of tasks
            snapshot, records, _ = await session.store.read_for_boot_soon()
            workspace = await asyncio.to_thread(self._workspaces.prepare, session)  # an image: mkfs, mount
        except BaseException as exc:
            drop_pending(self.spawner, pending)
            if isinstance(exc, StoreDamaged) and self._damaged is not None:
                raise self._damaged(session, exc) from None
            if (refusal := out_of_fds(exc, "cannot open its files: ")) is not None:
                raise refusal from None  # a refusal: nothing of the session is touched
            if isinstance(exc, OSError):
                raise Internal(f"cannot read its state: {exc}") from None
            raise
        try:
            pid, sock = await (pending if pending is not None else self.spawner.request())
        except SpawnerDied as exc:
            raise Internal(str(exc)) from None
        now = time.monotonic()
        worker: WorkerProc
        proto: FramedProtocol[m.FromWorker] = FramedProtocol(
            _worker_decoder,
            max_frame_bytes=_WORKER_FRAME_LIMIT,
            on_message=lambda msg: self._on_message(session, worker, msg),
            on_bad_message=lambda exc: self._on_bad_frame(session, worker, exc),
            pacer=self._ledger.pacer,
        )
        worker = WorkerProc(pid=pid, conn=proto, ready=loop.create_future(), exited=loop.create_future(),
                            started_at=now, last_heartbeat=now, beat_at=now)
        session.worker, session.memory = worker, SessionMemory()
        self._sessions.relive(session)
        self.by_pid[pid] = session
        await loop.create_unix_connection(lambda: proto, sock=sock)
        run_as = self._workspaces.run_as(session)
        if self.cgroups is not None:
            # Before Boot: no code of the session has run yet.
            self.containment.attach(session, pid)
        proto.send(
            m.Boot(
                session=session.id, handler=session.meta.handler,
                settings=_settings_encoder.encode(session.settings),
                workspace=str(workspace), depth=session.meta.depth,
                turns=session.turns, snapshot=snapshot, records=records,
                run_as_uid=run_as[0] if run_as else None,
                run_as_gid=run_as[1] if run_as else None,
                sandbox=self.sandbox,
            )
        )
        if during_boot is not None:
            proto.flush()  # Boot goes out first, then our own work
            try:
                durable = during_boot()
                if durable is not None:
                    await durable  # its fsyncs run off the loop, beside the boot
            except BaseException:
                worker.expected = "discarded"
                self.spawner.kill_tree(pid)
                raise
        timeout = self._config().daemon.boot_timeout_secs
        try:
            await asyncio.wait_for(asyncio.shield(worker.ready), timeout)
        except asyncio.TimeoutError:
            self.kill(session, worker, ExitReason.BOOT_FAILED, "no Ready within boot_timeout_secs")
            raise Internal(f"worker did not become ready within {timeout:g}s") from None
        self._events.set_state(session, Trigger.READY)
        self._ledger.active(session)

    # ---------------------------------------------------------------- messages

    def _on_bad_frame(self, session: Session, worker: WorkerProc, exc: ProtocolError) -> None:
        # A worker that speaks garbage is broken: kill it; it restarts from the log.
        self.kill(session, worker, ExitReason.CRASHED, f"protocol error: {exc}")

    def _on_message(self, session: Session, worker: WorkerProc, msg: m.FromWorker) -> None:
        """The one boundary between a worker's messages and the daemon: a
        bug in handling one fails the running turn with `internal` (logged
        with its traceback) and keeps the session and its worker."""
        if session.worker is not worker:
            return  # a message from a worker we have already replaced
        try:
            self._dispatch(session, worker, msg)
        except Exception as exc:
            tagged(log, session.id).exception("handling %s from worker %d failed",
                                              type(msg).__name__, worker.pid)
            with contextlib.suppress(Exception):
                self._ledger.end(session, failed=f"internal error: {type(exc).__name__}: {exc}")

    def _dispatch(self, session: Session, worker: WorkerProc, msg: m.FromWorker) -> None:
        """What a worker says of its own life is handled here; what it says
        in a turn goes to the turn's parts (supervisor.core.turnmessages)."""
        match msg:
            case m.Heartbeat():
                worker.last_heartbeat = worker.beat_at = time.monotonic()
            case m.Ready(sandbox=report):
                worker.sandbox = report
                worker.uses_steps = msg.uses_steps
                worker.booted = True
                worker.last_heartbeat = worker.beat_at = time.monotonic()
                if not worker.ready.done():
                    worker.ready.set_result(None)
            case m.BootFailed(reason=reason):
                worker.boot_error = reason
                if not worker.ready.done():
                    worker.ready.set_exception(Internal(f"boot failed: {reason}"))
                    worker.ready.exception()  # mark retrieved
            case m.WorkerPong(nonce=nonce):
                answer = session.pings.pop(nonce, None) if session.pings else None
                if answer is not None:
                    answer(None)
            case _:
                self._messages.dispatch(session, worker, msg)

    # ---------------------------------------------------------------- kills and exits

    def kill(self, session: Session, worker: WorkerProc, reason: ExitReason, detail: str,
             charged: bool = True) -> None:
        """The one way a live session's worker is killed for a reason of its
        own: recorded (so its exit is classified once, as `reason`), logged,
        and its whole tree killed.  The first reason stands.  `charged=False`:
        the store, not the worker, is at fault (it is ahead of the log, which
        could not save its input or its turn): it restarts from the log, and
        that restart is not counted against the restart intensity, so a full
        disk sends no session to `failed`."""
        if worker.kill_reason is None:
            worker.kill_reason = reason
            worker.kill_detail = detail
            worker.charged = charged
        tagged(log, session.id).warning("%s: %s; killing worker %d and its processes",
                                        reason, detail, worker.pid)
        self.spawner.kill_tree(worker.pid, session.memory.escapees())
        if self.cgroups is not None:
            self.cgroups.kill(session.id)

    def kill_discarded(self, session: Session) -> None:
        """A session that is being thrown away (its create failed)."""
        if session.worker is not None:
            tagged(log, session.id).warning("its create failed; killing worker %d", session.worker.pid)
            session.worker.expected = "discarded"
            self.spawner.kill_tree(session.worker.pid, session.memory.escapees())
            self.containment.release(session, session.worker.pid)

    def on_spawner_lost(self) -> None:
        for pid in list(self.by_pid):
            self.on_exit(pid, None, signal.SIGKILL, detail="the zygote died")

    def on_exit(self, pid: int, code: int | None, sig: int | None, detail: str = "") -> None:
        session = self.by_pid.pop(pid, None)
        if session is None:
            return
        worker = session.worker
        if worker is None or worker.pid != pid:
            self.spawner.kill_tree(pid)
            return
        if not worker.expected:
            # Tools left behind die with the worker: its group, the ones
            # that left the group but were seen as its descendants, and
            # everything in its cgroup.  (An expected exit is tidied up by
            # terminate, after a grace.)
            self.containment.oom_check(session, worker, dead=True)  # the kernel's OOM killer took it
            self.spawner.kill_tree(pid, session.memory.escapees())
            self.containment.release(session, pid)
        reason = classify(worker, code)
        if detail.startswith(NODE_LOST_PREFIX) and not worker.expected:
            # Lost with its node, whatever was tried first (a heartbeat kill
            # that could not land): the node is why, for the client and the model.
            reason, detail = ExitReason.NODE_LOST, detail.removeprefix(NODE_LOST_PREFIX)
        self.metrics.worker_exit(reason)
        info = m.ExitInfo(
            reason=reason, code=code, signal=sig, at=time.time(),
            detail=detail or worker.expected or worker.kill_detail or worker.boot_error,
        )
        worker.exited.set_result(info)
        if not worker.ready.done():
            worker.ready.set_exception(Internal(describe_exit(info)))
            worker.ready.exception()
        pings, session.pings = session.pings or {}, None
        for answer in pings.values():
            answer(Conflict(f"session {session.id}: the worker exited before answering"))
        session.worker, session.last_exit = None, info
        self._sessions.relive(session)
        if worker.expected:
            tagged(log, session.id).info("worker %d exited (%s)", pid, worker.expected)
            self._ledger.take_input(session)  # not retried: it was asked to go
            self._ledger.abort(session, f"the session was {worker.expected}")
            return
        tagged(log, session.id).warning("worker %d %s", pid, describe_exit(info))
        if not self._resumable.suspend(session, worker, info, describe_exit(info)):  # (resumed after the restart)
            self._ledger.abort(session, describe_exit(info))
        if session.state is State.STARTING and not worker.booted:
            return  # start()'s caller decides (create fails, revive retries)
        if session.state in LIVE:
            self._events.set_state(session, Trigger.EXIT, reason=reason)
            self.schedule_restart(session, charged=worker.charged)

    async def terminate(self, session: Session, expected: str, grace: float) -> None:
        """Stop a worker and everything it started, trio-style: ask, wait,
        then kill.  Shutdown to the worker and SIGTERM to its process group
        (the worker takes SIGTERM as Shutdown; tools get their chance to
        exit cleanly); after `grace`, SIGKILL to whatever is left."""
        worker = session.worker
        if worker is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        worker.expected = expected
        # Learn its descendants now, while they are still its descendants:
        # those that left the process group are signalled through the pidfds
        # taken as they were seen, never by a number that may be reused.
        session.memory.measure(self._proc_table, worker.pid)
        worker.conn.send(m.Shutdown())
        self.spawner.kill_tree(worker.pid, session.memory.escapees(), signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker.exited), grace)
        while loop.time() < deadline and self._alive(session, worker):
            await asyncio.sleep(0.02)
        if self._alive(session, worker):
            tagged(log, session.id).warning("processes still running %.1fs after SIGTERM; killing them",
                                            grace)
            if not worker.exited.done():
                # Children started during the grace: their handles too.
                session.memory.measure(self._proc_table, worker.pid)
        self.spawner.kill_tree(worker.pid, session.memory.escapees())
        if self.cgroups is not None:
            self.cgroups.kill(session.id)
        if not worker.exited.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.exited), 10.0)
        if self.cgroups is not None:
            # cgroup.kill is asynchronous: a cgroup goes only once empty.
            for _ in range(50):
                if not self.cgroups.pids(session.id):
                    break
                await asyncio.sleep(0.02)
        self.containment.release(session, worker.pid)
        if session.worker is None:  # (its tree is gone: what a session at rest keeps of its figures)
            session.memory = session.memory.at_rest()

    def stopping_for(self, session: Session, exit_reason: ExitReason) -> None:
        """The worker's exit is recorded as the limit it is stopped for, from
        the moment it is seen: never a plain "stopped" meanwhile."""
        if session.worker is not None:
            session.worker.stop_reason = exit_reason

    def stopped_for(self, session: Session, exit_reason: ExitReason, detail: str) -> None:
        """The last exit says the limit the session was stopped for."""
        if session.last_exit is not None:
            session.last_exit = msgspec.structs.replace(session.last_exit, reason=exit_reason.value, detail=detail)

    def heard_from(self, worker: WorkerProc, at: float) -> None:
        """Its heartbeat allowance counts from `at`."""
        worker.last_heartbeat = max(worker.last_heartbeat, at)

    def reconfigure(self, session: Session, old: SessionSettings) -> None:
        """The session's settings changed (a reload): its restart policy
        starts over, and a live worker gets the new settings and limits."""
        session.policy = None
        worker = session.worker
        if worker is None or worker.exited.done():
            return
        # The worker may be asleep for one old interval before it beats
        # at the new pace: do not count that against it.
        self.heard_from(worker, time.monotonic() + old.agent.worker.heartbeat_interval_secs)
        worker.conn.send(m.Reconfigure(settings=_settings_encoder.encode(session.settings)))
        self.containment.limit(session)

    def restore_exits(self, session: Session, restarts: int, last_exit: m.ExitInfo | None) -> None:
        """Restarts and the last exit as the store has them (claimed back)."""
        session.restarts = restarts
        if last_exit is not None:
            session.last_exit = last_exit

    def _alive(self, session: Session, worker: WorkerProc) -> bool:
        """Anything of the session still running: its tree, the escapees
        seen, and (with cgroups) whatever is in its cgroup."""
        if self.spawner.tree_alive(worker.pid, session.memory.escapees()):
            return True
        return self.cgroups is not None and bool(self.cgroups.pids(session.id))

    # ---------------------------------------------------------------- restarts

    def schedule_restart(self, session: Session, charged: bool = True) -> None:
        """`charged`: the exit counts against the restart intensity (not one
        the store caused: `kill`)."""
        if self._closing():
            return
        ws = session.settings.agent.worker
        if session.policy is None:
            session.policy = RestartPolicy(ws.max_restart_attempts, ws.restart_window_secs,
                                           ws.restart_backoff_initial_ms, ws.restart_backoff_max_ms)
        decision = session.policy.on_failure(time.monotonic()) if charged else session.policy.not_charged()
        if not decision.restart:
            tagged(log, session.id).error("giving up restarting it after %d failures within %gs (last: %s); "
                                          "`sessionctl restart %s` tries again",
                                          decision.attempts_in_window, ws.restart_window_secs,
                                          describe_exit(session.last_exit), session.id)
            self._events.set_state(session, Trigger.GIVE_UP,
                                   reason=f"{decision.attempts_in_window} failures within {ws.restart_window_secs:g}s")
            self._events.emit_limit(session, LimitKind.RESTARTS, decision.attempts_in_window,
                                    ws.max_restart_attempts)
            self._events.write_mark(session, durable=False)
            self._resumable.drop_suspended(session, "the session failed: too many restarts")
            self._ledger.save_soon(session, "the failed state")  # off the loop: the store may be away
            return
        self._events.set_state(session, Trigger.BACKOFF, reason=f"restart in {decision.delay_secs:.3f}s")
        loop = asyncio.get_running_loop()
        session.restart_handle = loop.call_later(
            decision.delay_secs, lambda: self._spawn_task(self._auto_restart(session))
        )

    def cancel_restart(self, session: Session) -> None:
        """No restart comes (a stop, restart, rm, takeover, shutdown): nor
        does the resume of a turn its worker died in."""
        if session.restart_handle is not None:
            session.restart_handle.cancel()
            session.restart_handle = None
        self._resumable.drop_suspended(session, "its session was stopped before the turn could resume")

    async def _auto_restart(self, session: Session) -> None:
        session.restart_handle = None
        async with session.locked():
            if session.state is not State.RESTARTING or self._closing():
                return
            try:
                await self._make_room(session)
            except Capacity:
                self._events.set_state(
                    session, Trigger.HIBERNATE,
                    reason="no room to restart (max_concurrent_sessions); the next input revives it",
                )
                self._resumable.drop_suspended(session, "no room to restart it (max_concurrent_sessions)")
                return
            session.restarts += 1
            self.metrics.restart()
            self._events.write_mark(session, durable=False)
            if await self._held_elsewhere(session):
                return
            self._events.set_state(session, Trigger.SPAWN, reason=f"restart #{session.restarts}")
            try:
                await self.start(session)
            except SessiondError as exc:
                tagged(log, session.id).warning("restart failed: %s", exc)
                if session.is_(State.STARTING):
                    self._events.set_state(session, Trigger.EXIT, reason="boot_failed")
                    self.schedule_restart(session)
                return
            self._resumable.resume(session)  # the turn its worker died in, if it was held open

    async def _held_elsewhere(self, session: Session) -> bool:
        """Whether another daemon took the session over since it was loaded
        (daemons sharing a database): then it is not restarted here, where a
        second worker would run on the other daemon's records, but handed
        to the ledger's `on_fenced` (supervisor.core.fencing stops it).  Checked
        by making the restart's mark durable: the commit is fenced.  A store
        that cannot write for another reason does not stop the restart."""
        try:
            await session.store.sync_soon()
        except Fenced as exc:
            self._ledger.on_fenced(session, exc)
            return True
        except StoreError as exc:
            tagged(log, session.id).warning("restart mark not saved: %s", exc)
        return False
