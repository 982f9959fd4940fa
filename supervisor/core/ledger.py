"""Turns and their durability: an input is acknowledged only once it is on
disk, a turn is done only once its output is.

Runs in the daemon's loop.  The ordering rules that make the durability
promises true live here and only here:
* an input is appended, and fsync'd, before `Accepted` is sent;
* a turn's output is appended, and fsync'd, before `TurnDone` is sent;
* a turn that ends without a commit (its worker died, it failed) gets an
  `Abort` record and a `TurnFailed` event naming the cause;
* a step of a turn (`ctx.step`) is made durable through this ledger too;
  the resumable turn (its steps, held open across a worker's death and
  resumed) is `supervisor.core.resumable`'s, a part the ledger builds.

Group commit: the worker starts on an input before it is durable, and the
input and the turn's commit are made durable by the store's group commit
(`sync_soon`: one fdatasync, off the loop, for whatever every session has
pending), so neither the loop nor other sessions wait for a disk flush.
A session whose turns are quick (echo) asks for no flush of its input:
the commit's flush, within `_QUICK_TURN_SECS`, covers both.
`Accepted` always waits for the flush that covers the input, `TurnDone`
for the one that covers the commit; until then the turn is still running
(`session.committing` names it, so a worker death meanwhile does not
abort a turn whose commit is already written).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from ipc import messages as m
from ipc.pacing import Pacer
from supervisor.errors import Conflict, Internal, NoSpace, SessiondError
from supervisor.core.asks import Asks
from supervisor.core.budgets import Budgets
from supervisor.core.events import EventLog
from supervisor.core.fdbudget import out_of_fds
from supervisor.core.resumable import ResumableTurns
from supervisor.logtag import tagged
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.registry import Registry
from supervisor.core.session import PendingInput, Session, WorkerProc
from supervisor.core.tracer import NO_TRACER, Tracer, TurnTrace
from supervisor.core.states import State, Trigger
from supervisor.store.state_store import (
    Abort, Commit, Fenced, IdTaken, InputRecord, Mark, SessionLog, Snapshot, StoreError, StoreFull, add_usage,
)

__all__ = ["TurnLedger", "store_failure"]

log = logging.getLogger("sessiond.manager")

# A session whose last turn took less than this (echo, a calculator) likely
# ends this one as quickly: its input waits that long for the commit's flush
# instead of taking a flush of its own (one fdatasync per turn, not two).
_QUICK_TURN_SECS = 0.002


class TurnLedger:
    def __init__(
        self,
        events: EventLog,
        *,
        on_unsaved: Callable[[Session, WorkerProc, str], None],
        on_turn_started: Callable[[Session, int], None],
        on_turn_ended: Callable[[Session], None],
        on_fenced: Callable[[Session, Fenced], None] | None = None,
        metrics: Recorder = NO_METRICS,
        tracer: Tracer = NO_TRACER,
        budgets: Budgets | None = None,
    ) -> None:
        self._events = events
        # What a turn may spend ([agent.budget]): told to its worker with the input.
        self._budgets = budgets if budgets is not None else Budgets(Registry(), metrics=metrics)
        # What to do with a worker that is ahead of the disk (kill it; it
        # restarts from the log), and with a turn that has begun (arm its
        # timeout): the manager's, passed in when it builds the ledger.
        self.on_unsaved = on_unsaved
        self.on_turn_started = on_turn_started
        self.on_turn_ended = on_turn_ended  # (disarm its timeout)
        # ... and with a session that another daemon took over
        # (supervisor.core.fencing); without one, as a worker ahead of the disk.
        self.on_fenced: Callable[[Session, Fenced], None] = on_fenced or self._unsaved
        self.metrics = metrics
        self._tracer = tracer
        # The daemon's data-plane work, in bounded slices (ipc.pacing): the
        # workers' messages and exits, flushes' completions, clients' inputs.
        self.pacer = Pacer()
        # The running turns' permission requests (`asked`, `answer`, `waiting`).
        self._asks = Asks(events)
        # The resumable turn: its steps journaled, held open across a worker's death, resumed.
        self.resumable = ResumableTurns(self, events, self._asks, tracer)

    def begin(
        self, session: Session, text: str, on_accepted: Callable[[m.Accepted], None] | None = None,
        trace: TurnTrace | None = None,
    ) -> asyncio.Future[m.Accepted]:
        """Start a turn on the session's worker; the future resolves (and
        `on_accepted` is called, synchronously, before any later event of
        the turn) once the input is durable.  `trace`: the input's, from its
        arrival (supervisor.core.tracer), when tracing is on."""
        turn = session.turns + 1
        worker = session.worker
        assert worker is not None
        try:
            session.store.append(
                InputRecord(turn=turn, text=text, seq=session.seq, at=time.time()), durable=False
            )
        except StoreError as exc:
            self._events.release(session)
            raise store_failure("input not accepted: ", exc) from None
        session.trace = self._tracer.begin(session.id, turn, session.meta.handler, trace, text=text,
                                           owner_uid=session.meta.owner_uid)
        worker.conn.send(self.input_message(session, turn, text))
        worker.conn.flush()
        loop = asyncio.get_running_loop()
        accepted = m.Accepted(id=0, session=session.id, turn=turn, seq=session.seq)
        durable: asyncio.Future[m.Accepted] = loop.create_future()
        pending = session.pending_input = PendingInput(accepted, durable, on_accepted)
        if session.last_turn_secs < _QUICK_TURN_SECS:
            # Its commit will likely come within the window and carry the
            # input in the same flush; if not, the timer asks for it.
            pending.timer = loop.call_later(_QUICK_TURN_SECS, self.flush_input, session, pending)
        else:
            self.flush_input(session, pending)
        session.turns = turn
        session.current_turn = turn
        session.current_input = text
        self.resumable.reset(session)
        session.last_active = time.monotonic()
        session.turn_started = time.monotonic()
        self.on_turn_started(session, turn)
        self.metrics.turn_started(session)
        self._events.set_state(session, Trigger.INPUT, reason=f"turn {turn}")
        return durable

    def streaming(self, session: Session) -> None:
        """The turn is streaming: its client wants Accepted (and the text)
        now, not after the quick-turn window.  Asked once this batch of
        worker messages is handled: a Done in the same batch makes the
        commit's flush cover the input (one flush, not two in a row)."""
        pending = session.pending_input
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
            self.pacer.defer(self.flush_input, session, pending)

    def flush_input(self, session: Session, pending: PendingInput) -> None:
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if session.pending_input is pending and not pending.flushing and session.committing is None:
            pending.flushing = True
            self.when_durable(session, lambda err: self._input_saved(session, err))

    def when_durable(self, session: Session, then: Callable[[StoreError | None], None]) -> None:
        """`then(None)` once every append of `session` so far is durable,
        `then(error)` if that failed (the store cut them back)."""
        try:
            fut = session.store.sync_soon()
        except StoreError as exc:
            then(exc)
            return

        def done(f: asyncio.Future[None]) -> None:
            exc = f.exception()
            then(exc if isinstance(exc, StoreError) or exc is None else StoreError(str(exc)))

        # One flush completes every session's turn at once: paced, so that
        # the loop reads between them.
        fut.add_done_callback(lambda f: self.pacer.now_or_later(done, f))

    async def save_mark(self, session: Session) -> None:
        """`write_mark(durable=True)` (a stop, a restart) without blocking
        the loop: made durable by the group commit; a failure is logged,
        as there."""
        self._events.write_mark(session, durable=False)
        try:
            await session.store.sync_soon()
        except StoreError as exc:
            tagged(log, session.id).error("%s", exc)

    def _input_saved(self, session: Session, exc: StoreError | None) -> None:
        pending = session.pending_input
        if pending is None or pending.accepted.turn != session.current_turn:
            return  # covered by a later flush (the commit's), or the turn is over
        if exc is not None:
            self.input_durable(session, store_failure("input not accepted: ", exc))
            # Refused, so over: never resumed on the next worker as if accepted.
            self.end(session, failed=f"its input could not be saved: {exc}")
            if isinstance(exc, Fenced):
                self.on_fenced(session, exc)
            elif session.worker is not None:
                # It has an input the log does not: it must restart from the log.
                tagged(log, session.id).error("input not saved (%s)", exc)
                self.on_unsaved(session, session.worker, f"its input could not be saved: {exc}")
            return
        self.input_durable(session)

    def input_durable(self, session: Session, error: SessiondError | None = None) -> None:
        """After the fsync that covers the pending input: acknowledge it
        (synchronously, so `Accepted` precedes the turn's last events)."""
        pending, session.pending_input = session.pending_input, None
        if pending is not None:
            self._settle_input(session, pending, error)

    def spent(self, session: Session, msg: m.Spent) -> None:
        """The running turn's spend so far, after one of its LLM calls, or
        a call about to begin (counted first: supervisor.core.budgets)."""
        self._budgets.reported(session, msg)

    def commit(self, session: Session, worker: WorkerProc, msg: m.Done) -> None:
        if msg.turn != session.current_turn:
            tagged(log, session.id).warning("Done for turn %d, expected %s", msg.turn, session.current_turn)
            return
        if session.committing is not None:
            tagged(log, session.id).warning("a second Done for turn %d", msg.turn)
            return
        seq = session.seq + 1
        began = time.monotonic()
        try:
            session.store.append(
                Commit(turn=msg.turn, reply=msg.reply, record=msg.record, interrupted=msg.interrupted,
                       seq=seq, usage=_turn_usage(session, msg), stop_reason=msg.stop_reason,
                       stop_detail=msg.stop_detail),
                durable=False,
            )
            self.metrics.commit(time.monotonic() - began)
        except StoreError as exc:
            self._commit_failed(session, worker, msg, exc)
            return
        session.committing = msg.turn
        if session.trace is not None:
            self._tracer.commit_started(session.trace)
        self.when_durable(session, lambda err: self._committed(session, worker, msg, err))

    def _commit_failed(self, session: Session, worker: WorkerProc, msg: m.Done, exc: StoreError) -> None:
        # The worker is now ahead of the disk: make it restart from the disk.
        # (Its successor, if it died during the flush, booted from a log
        # that held the commit: it is ahead too.)
        tagged(log, session.id).error("turn %d not persisted: %s", msg.turn, exc)
        self.end(session, failed=f"the turn could not be saved: {exc}")
        if isinstance(exc, Fenced):
            self.on_fenced(session, exc)
        elif session.worker is not None:
            # (Why, with the store's words: a turn begun on it before it is
            # gone fails with them too.)
            self.on_unsaved(session, session.worker, f"its turn could not be saved: {exc}")

    def _unsaved(self, session: Session, exc: Fenced) -> None:
        if session.worker is not None:
            self.on_unsaved(session, session.worker, str(exc))

    def _committed(self, session: Session, worker: WorkerProc, msg: m.Done, exc: StoreError | None) -> None:
        """The flush that covers the commit is done (or failed)."""
        if session.committing != msg.turn or session.current_turn != msg.turn:
            return  # the session was removed or its turn ended otherwise meanwhile
        session.committing = None
        if exc is not None:
            self._commit_failed(session, worker, msg, exc)
            return
        self.input_durable(session)  # the commit's flush covered the input
        if session.trace is not None:
            self._tracer.ended(session.id, session.trace, done=msg)
            session.trace = None
        add_usage(session.usage, _turn_usage(session, msg))
        if msg.snapshot:
            self._snapshot(session, msg.snapshot)
        self._turn_over(session, (True, msg.reply))
        session.current_input = ""
        # Events sent during the flush (a notice, a limit) took seqs after
        # the Commit record's: TurnDone takes the next one, in order.
        seq = self._events.next_seq(session)
        self._events.emit(
            session,
            m.TurnDone(session=session.id, seq=seq, turn=msg.turn, reply=msg.reply,
                       interrupted=msg.interrupted, stop_reason=msg.stop_reason,
                       stop_detail=msg.stop_detail, usage=msg.usage),
        )
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._events.set_state(session, Trigger.TURN_END)

    def _snapshot(self, session: Session, handler_state: bytes) -> None:
        """Queued (`write_snapshot_soon`): TurnDone does not wait for it."""
        last = msgspec.to_builtins(session.last_exit) if session.last_exit else None
        try:
            written = session.store.write_snapshot_soon(
                Snapshot(
                    gen=0, meta=session.meta, turns=session.turns, seq=session.reserved_seq,
                    handler_state=handler_state, usage=dict(session.usage),
                    lifecycle=self._events.lifecycle_kept(session),
                    mark=Mark(state=session.persisted_state, seq=session.reserved_seq,
                              restarts=session.restarts, last_exit=last),
                )
            )
        except StoreError as exc:
            tagged(log, session.id).warning("%s (the log still holds every turn)", exc)
            return
        written.add_done_callback(lambda f: _snapshot_failed(session, f))

    def worker_spans(self, session: Session, msg: m.WorkerSpans) -> None:
        """Spans the worker recorded in the running turn (untrusted: the
        tracer checks them), into that turn's trace."""
        if session.trace is not None and msg.turn == session.current_turn:
            self._tracer.worker_spans(session.trace, msg)

    def input_message(self, session: Session, turn: int, text: str, resumed: m.Resumed | None = None) -> m.Input:
        """The turn's input as its worker gets it: at the turn's start, and
        to a worker that resumes it; with the budget figures the worker
        checks before each LLM call, and whether to record spans."""
        spent, uid_spent = self._budgets.for_input(session)
        trace = session.trace
        return m.Input(turn=turn, text=text, resumed=resumed, spent=spent, uid_spent=uid_spent,
                       trace=trace is not None, trace_content=trace is not None and trace.content,
                       trace_id=trace.trace_id if trace is not None else "")

    def asked(self, session: Session, msg: m.AskPermission) -> None:
        self._asks.asked(session, msg)

    def answer(self, session: Session, request_id: str, allow: bool, uid: int | None, client: str) -> None:
        self._asks.answer(session, request_id, allow, uid, client)

    def waiting(self, session: Session) -> list[m.Waiting]:
        return self._asks.waiting(session)

    def unseen_asks(self, session: Session, from_seq: int | None, oldest: int) -> list[m.PermissionRequest]:
        return list(self._asks.unseen(session, from_seq, oldest))

    def resumed(self, session: Session, detail: str = "") -> None:
        """The running turn goes on on a new worker (the resume path's hook)."""
        self._tracer.resumed(session.trace, detail)

    def fail(self, session: Session, msg: m.Failed) -> None:
        if msg.turn != session.current_turn:
            return
        session.current_input = ""
        self.abort(session, msg.reason, msg.record)
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._events.set_state(session, Trigger.TURN_END, reason="turn failed")

    def abort(self, session: Session, reason: str, record: bytes = b"") -> None:
        """The running turn ends without a commit (if one runs).  Nothing
        here waits for the store on the loop (a database outage must not
        stall every other session, nor make their workers look silent): the
        `Abort` record goes with the group commit's next flush (a crash
        before it lands leaves the input open, and load aborts it then).
        `TurnFailed` is sent at once, or, when the turn's input is not
        acknowledged yet, once the flush that covers the input is done:
        `Accepted` always comes first."""
        turn = session.current_turn
        if turn is None:
            return
        if session.committing == turn:
            # Its commit is written and being flushed: the turn ends when
            # the flush does (TurnDone), or fails (then it is aborted).
            return
        seq = session.seq + 1
        try:
            session.store.append(Abort(turn=turn, reason=reason, record=record, seq=seq,
                                       usage=dict(session.turn_spend)), durable=False)
        except StoreError as exc:
            tagged(log, session.id).error("%s", exc)
            if isinstance(exc, Fenced):  # e.g. its worker missed heartbeats while this daemon was frozen
                self.on_fenced(session, exc)
        pending, session.pending_input = session.pending_input, None
        if pending is not None and pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if session.trace is not None:
            self._tracer.ended(session.id, session.trace, failed=reason)
            session.trace = None
        add_usage(session.usage, session.turn_spend)  # billed, committed or not
        self._turn_over(session, (False, reason))
        if pending is None:
            self._events.next_seq(session)
            self._events.emit(session, m.TurnFailed(session=session.id, seq=seq, turn=turn, reason=reason))
            self.save_soon(session, f"the abort of turn {turn}")
            return

        def saved(err: StoreError | None) -> None:
            if err is not None:
                tagged(log, session.id).error("the abort of turn %d was not saved: %s", turn, err)
            failure = store_failure("input not accepted: ", err) if err is not None else None
            self._settle_input(session, pending, failure)
            self._events.emit(session, m.TurnFailed(session=session.id, seq=self._events.next_seq(session),
                                                    turn=turn, reason=reason))

        self.when_durable(session, saved)

    def _settle_input(self, session: Session, pending: PendingInput, error: SessiondError | None) -> None:
        """Acknowledge an input (or fail it): `Accepted` to its client, then
        the turn's events held for it (supervisor.core.events: `hold`)."""
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None
        if session.trace is not None:
            self._tracer.input_durable(session.trace, error.message if error is not None else "")
        if error is not None:
            pending.durable.set_exception(error)
            pending.durable.exception()  # retrieved by whoever awaits, if anyone
            # The sender's held events after its Error, which the future's
            # callbacks (scheduled just now) write.
            asyncio.get_running_loop().call_soon(self._events.release, session, list(session.held or ()))
            return
        if pending.on_accepted is not None:
            pending.on_accepted(pending.accepted)
        self._events.release(session)  # the turn's events, after Accepted
        pending.durable.set_result(pending.accepted)

    def save_soon(self, session: Session, what: str) -> None:
        """Every append of `session` so far made durable by the next group
        commit, off the loop; a failure is logged (`what` was not saved)."""
        def saved(err: StoreError | None) -> None:
            if err is not None:
                tagged(log, session.id).error("%s was not saved: %s", what, err)

        self.when_durable(session, saved)

    def abort_stored(self, session: Session, store: SessionLog, turn: int, reason: str, durable: bool) -> None:
        """A turn the log holds open, found at load or at a claim: the daemon
        that ran it died during it, and what it streamed is gone."""
        store.append(Abort(turn=turn, reason=reason, seq=self._events.advance_seq(session)), durable=durable)

    def take_input(self, session: Session) -> str:
        """The aborted turn's input, once, dropped (a turn whose worker died
        is resumed by `resume`, never begun again as a new one)."""
        text, session.current_input = session.current_input, ""
        return text

    def active(self, session: Session) -> None:
        """The idle clock starts again (a worker started)."""
        session.last_active = time.monotonic()

    def reopen(self, session: Session, turn: int, text: str) -> None:
        """At load: the turn the daemon died in is the running one again (held open, to resume)."""
        session.current_turn, session.current_input = turn, text
        session.turn_started = time.monotonic()

    def clock_again(self, session: Session) -> None:
        """A held turn goes on on a new worker: its time and the idle clock count from now."""
        session.turn_started = session.last_active = time.monotonic()

    def restore_totals(self, session: Session, turns: int, usage: dict[str, int]) -> None:
        """The turns and usage as the store has them (claimed from another daemon)."""
        session.turns, session.usage = turns, usage

    def end(self, session: Session, failed: str) -> None:
        self.abort(session, failed)
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._events.set_state(session, Trigger.TURN_END, reason="turn failed")

    def _turn_over(self, session: Session, outcome: tuple[bool, str]) -> None:
        fut = session.turn_results.pop(session.current_turn or 0, None) if session.turn_results else None
        if fut is not None and not fut.done():
            fut.set_result(outcome)
        session.current_turn = None
        self.resumable.over(session)
        self._budgets.turn_over(session)
        session.last_turn_secs = time.monotonic() - session.turn_started
        self.metrics.turn_ended(session, outcome[0], outcome[1], session.last_turn_secs)
        self._asks.drop(session)
        session.last_active = time.monotonic()
        self.on_turn_ended(session)


def _turn_usage(session: Session, msg: m.Done) -> dict[str, int]:
    """What the turn spent: the usage its handler returned, and what its
    worker reported as it went (the LLM calls; tokens of a handler that
    reports them only one way)."""
    usage = dict(msg.usage)
    for key, value in session.turn_spend.items():
        usage[key] = max(value, usage.get(key, 0))
    return usage


def _snapshot_failed(session: Session, written: asyncio.Future[None]) -> None:
    exc = None if written.cancelled() else written.exception()
    if exc is not None:
        tagged(log, session.id).warning("%s (the log still holds every turn)", exc)


def store_failure(prefix: str, exc: StoreError) -> SessiondError:
    """A store error as a client hears it: `no_space` for a full disk,
    `conflict` for an id another daemon sharing the store took first."""
    if isinstance(exc, StoreFull):
        return NoSpace(f"{prefix}{exc}")
    if (refusal := out_of_fds(exc, prefix)) is not None:
        return refusal
    if isinstance(exc, IdTaken):
        return Conflict(f"{prefix}{exc}")
    return Internal(f"{prefix}{exc}")
