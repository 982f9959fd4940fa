"""The resumable turn: a turn's steps journaled as they begin and end, the
turn held open when its worker dies, and resumed on the next worker with
its steps read back from the store.

Runs in the daemon's loop.  The rules are the pure ones of
`supervisor.core.steps` (`step_problem`, `resumes_after`, `cause_of`,
`plan_resume`); the durable bookkeeping they ride on (an append made
durable by the group commit, the input acknowledged, a turn aborted, the
input a worker is sent) is the turn ledger's (`supervisor.core.ledger`),
which builds this part with itself and asks it to `reset` a turn's steps
as a turn begins and to forget a held turn as one ends (`over`):
* a step (`ctx.step`) is appended, and fsync'd, before the worker hears
  `StepSaved`; its start is appended when it begins (made durable before
  the worker runs it when the worker asks: steps overlap);
* a turn whose worker dies is held open (`suspend`; at load, the turn a
  dead daemon left: `suspend_stored`) and resumed on the next worker
  (`resume`), or aborted then (`drop_suspended`: the restarts gave up, the
  session was stopped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ipc import messages as m
from ipc.pacing import Pacer
from supervisor.core.asks import Asks
from supervisor.core.events import EventLog
from supervisor.logtag import tagged
from supervisor.core.session import PendingInput, Session, Suspension, WorkerProc
from supervisor.core.tracer import Tracer
from supervisor.core.states import State, Trigger
from supervisor.core.steps import DAEMON_STOPPED, cause_of, plan_resume, resumes_after, step_problem
from supervisor.store.state_store import (
    Fenced, LoadedSession, Resume, Step, StepRecord, StepStart, StoreError,
)

__all__ = ["ResumableTurns", "TurnBook"]

log = logging.getLogger("sessiond.manager")

# The keys of the steps in flight a `turn_resumed` notice names, at most.
_NOTICE_KEYS = 32


class TurnBook(Protocol):
    """What the resumable turn asks of the turn ledger (TurnLedger)."""

    pacer: Pacer
    on_fenced: Callable[[Session, Fenced], None]

    def when_durable(self, session: Session, then: Callable[[StoreError | None], None]) -> None: ...
    def input_durable(self, session: Session) -> None: ...
    def flush_input(self, session: Session, pending: PendingInput) -> None: ...
    def abort(self, session: Session, reason: str, record: bytes = b"") -> None: ...
    def input_message(self, session: Session, turn: int, text: str, resumed: m.Resumed | None = None) -> m.Input: ...
    def resumed(self, session: Session, detail: str = "") -> None: ...
    def on_turn_started(self, session: Session, turn: int) -> None: ...
    def on_turn_ended(self, session: Session) -> None: ...
    def reopen(self, session: Session, turn: int, text: str) -> None: ...
    def clock_again(self, session: Session) -> None: ...


class ResumableTurns:
    def __init__(self, ledger: TurnBook, events: EventLog, asks: Asks, tracer: Tracer) -> None:
        self._ledger = ledger
        self._events = events
        self._asks = asks  # (a held turn's permission requests are dropped: its new worker asks again)
        self._tracer = tracer

    def reset(self, session: Session) -> None:
        """A turn begins: no step counted yet, none in flight."""
        session.step_records, session.step_bytes, session.steps_flying = 0, 0, None

    def over(self, session: Session) -> None:
        """The turn ended: nothing held open, no step counted."""
        session.suspended = None
        self.reset(session)

    def step(self, session: Session, worker: WorkerProc, msg: m.StepBegun | m.StepDone) -> None:
        """A step of the running turn begins or ends: its record appended
        (supervisor.core.steps: `StepStart`, `Step`), and `StepSaved` once
        durable, for an end and for a start the worker waits on."""
        begun = isinstance(msg, m.StepBegun)
        # Whether the worker waits on it: an end with a result, a start it asked to be durable.
        answered = msg.durable if isinstance(msg, m.StepBegun) else not msg.failed
        if msg.turn != session.current_turn or session.committing is not None:
            if answered:
                worker.conn.send(m.StepSaved(turn=msg.turn, n=msg.n, begun=begun, error="the turn is not running"))
            return
        problem = step_problem(session.settings, session.current_turn, session.step_bytes, session.steps_flying or {},
                               msg)
        rec: StepRecord
        if isinstance(msg, m.StepBegun):
            rec = StepStart(turn=msg.turn, n=msg.n, key=msg.key, kind=msg.kind)
        else:
            rec = Step(turn=msg.turn, n=msg.n, key=msg.key, kind=msg.kind, result=msg.result, failed=msg.failed)
        if not problem:
            try:
                session.store.append(rec, durable=False)
            except StoreError as exc:
                problem = f"step {msg.n} not saved: {exc}"
        if problem:
            tagged(log, session.id).warning("%s", problem)
            worker.conn.send(m.StepSaved(turn=msg.turn, n=msg.n, begun=begun, error=problem))
            return
        session.step_records += 1
        session.step_bytes += rec.size
        if session.trace is not None:
            self._tracer.step(session.trace, msg)
        if begun:
            session.steps_flying = session.steps_flying or {}
            session.steps_flying[msg.n] = msg.key
        elif session.steps_flying:
            session.steps_flying.pop(msg.n, None)
        if not answered:
            return  # (a start the worker does not wait on: carried by the next flush)
        self._ledger.when_durable(session, lambda err: self._step_saved(session, worker, msg, err))

    def _step_saved(self, session: Session, worker: WorkerProc, msg: m.StepBegun | m.StepDone,
                    exc: StoreError | None) -> None:
        begun = isinstance(msg, m.StepBegun)
        if exc is None:
            self._ledger.input_durable(session)  # the step's flush covered the input
            if session.worker is worker:
                worker.conn.send(m.StepSaved(turn=msg.turn, n=msg.n, begun=begun))
                worker.conn.flush()  # now: the worker may wait on it to run a tool
            return
        # The store cut back what was not durable (its byte count stays: the turn fails).
        if isinstance(exc, Fenced):
            self._ledger.on_fenced(session, exc)
        elif session.worker is worker:
            worker.conn.send(m.StepSaved(turn=msg.turn, n=msg.n, begun=begun, error=f"step {msg.n} not saved: {exc}"))

    def suspend(self, session: Session, worker: WorkerProc, info: m.ExitInfo, failure: str) -> bool:
        """The running turn's worker died: hold the turn open to resume on
        the next worker (True), or not (False: the caller aborts it)."""
        turn = session.current_turn
        if turn is None or session.committing == turn:
            return False
        if session.suspended is not None:
            return True  # the restarted worker died before it was resumed
        if (not resumes_after(session.settings, info) or not (worker.uses_steps or session.step_records)
                or session.state is State.INTERRUPTING):  # (the client wanted it over)
            return False
        session.suspended = Suspension(
            turn=turn, text=session.current_input, reason=info.reason, cause=cause_of(info, session.settings),
            failure=failure,
        )
        if session.trace is not None:
            self._tracer.worker_lost(session.trace, failure)
        session.steps_flying = None  # (its steps in flight are in the store: read back at the resume)
        self._asks.drop(session)
        pending = session.pending_input
        if pending is not None:
            self._ledger.flush_input(session, pending)  # it must be durable before the turn goes on
        self._ledger.on_turn_ended(session)  # (its timeout: the resumed run gets its own)
        return True

    def suspend_stored(self, session: Session, loaded: LoadedSession) -> bool:
        """At load: the daemon died during this turn.  True: it is held open
        to resume once a worker is ready (the caller starts one)."""
        open_input = loaded.open_input
        if (open_input is None or not session.settings.agent.worker.retry_aborted_turn
                or session.state is not State.HIBERNATED):  # (not a stopped or failed one)
            return False
        self._ledger.reopen(session, open_input.turn, open_input.text)
        session.step_records, session.step_bytes = loaded.open_step_records, loaded.open_step_bytes
        session.suspended = Suspension(
            turn=open_input.turn, text=open_input.text, reason=DAEMON_STOPPED,
            cause="the daemon stopped", failure="the daemon stopped during this turn",
            uncertain=True,
        )
        return True

    def resume(self, session: Session) -> None:
        """The restarted worker is ready: the suspended turn goes on there,
        as the same turn (clients see one turn), with its steps read back
        from the store (off the loop); until they are, it is running."""
        held = session.suspended
        worker = session.worker
        if held is None or worker is None:
            return
        if not (worker.uses_steps or session.step_records):
            self.drop_suspended(session, "")  # (a daemon restart: now we know its handler uses none)
            return
        try:
            read = session.store.read_steps_soon(held.turn)
        except StoreError as exc:
            self.drop_suspended(session, f"its steps could not be read back: {exc}")
            return
        self._ledger.clock_again(session)
        self._events.set_state(session, Trigger.INPUT,
                               reason=f"turn {held.turn} resumed after {held.reason}: {held.cause}")
        read.add_done_callback(lambda f: self._ledger.pacer.now_or_later(self._resume_read, session, worker, held, f))

    def _resume_read(self, session: Session, worker: WorkerProc, held: Suspension,
                     read: asyncio.Future[list[StepRecord]]) -> None:
        if session.suspended is not held or session.worker is not worker:
            return  # it died again, or the turn ended, meanwhile: a later resume reads again
        exc = read.exception() if not read.cancelled() else StoreError("the read was cancelled")
        if exc is not None:
            self.drop_suspended(session, f"its steps could not be read back: {exc}")
            if session.state in (State.RUNNING, State.INTERRUPTING):
                self._events.set_state(session, Trigger.TURN_END, reason="turn failed")
            return
        session.suspended = None
        self._ledger.on_turn_started(session, held.turn)  # (its timeout: from now, the input sent)
        plan = plan_resume(read.result())
        resumed = plan.resumed(held.reason, held.cause, held.uncertain)
        # (A traced turn's new worker records its spans too.)
        worker.conn.send(self._ledger.input_message(session, held.turn, held.text, resumed))
        if session.state is State.INTERRUPTING:  # asked for while the steps were read
            worker.conn.send(m.InterruptTurn(turn=held.turn))
        worker.conn.flush()
        step = plan.step
        self._ledger.resumed(session, f"at step {step} after {held.reason}: {held.cause}")
        try:  # for `history`; carried by the next flush (the next step's, the commit's)
            session.store.append(Resume(turn=held.turn, step=step, reason=held.reason, cause=held.cause,
                                        at=time.time(), running=resumed.running), durable=False)
        except StoreError as exc:
            tagged(log, session.id).warning("the resume of turn %d is not in the log: %s", held.turn, exc)
        flying = [f.key for f in plan.in_flight]
        tagged(log, session.id).warning("turn %d resumed at step %d (%s: %s; %d step(s) in flight)", held.turn,
                                        step, held.reason, held.cause, len(flying))
        self._events.emit(session, m.Notice(
            session=session.id, seq=self._events.next_seq(session), turn=held.turn, kind="turn_resumed",
            data={"reason": held.reason, "cause": held.cause, "step": step, "running": resumed.running,
                  "in_flight": flying[:_NOTICE_KEYS]}))

    def drop_suspended(self, session: Session, why: str) -> None:
        """A suspended turn that will not resume: it fails as it would have
        when its worker died, saying why."""
        held = session.suspended
        if held is None:
            return
        session.suspended = None
        self._ledger.abort(session, f"{held.failure}; {why}" if why else held.failure)
