"""What a worker says in a turn, handed to the part that owns it: its text
and reasoning as events, its Done and Failed to the ledger, its steps to
the resumable turn, its spend to the budgets, its permission requests, its
notices and limits, the subagents it asks for.

Runs in the daemon's loop, called by `WorkerOwner._dispatch` (inside its
one boundary for a worker's messages: a bug here fails the running turn,
never the daemon), which keeps what a worker says of its own life (its
heartbeats, Ready, BootFailed, pongs).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from ipc import messages as m
from ipc.contract import LimitKind
from ipc.settings import BudgetSettings
from supervisor.core.events import EventLog
from supervisor.core.ledger import TurnLedger
from supervisor.core.recorder import NO_METRICS, Recorder
from supervisor.core.resumable import ResumableTurns
from supervisor.core.session import Session, WorkerProc
from supervisor.core.subagents import Subagents

__all__ = ["TurnMessages"]


class TurnMessages:
    def __init__(
        self,
        events: EventLog,
        ledger: TurnLedger,
        resumable: ResumableTurns,
        subagents: Subagents,
        spawn_task: Callable[[Coroutine[Any, Any, None]], None],
        metrics: Recorder = NO_METRICS,
    ) -> None:
        self._events = events
        self._ledger = ledger
        self._resumable = resumable
        self._subagents = subagents
        self._spawn_task = spawn_task  # a subagent runs as a task of the manager's
        self.metrics = metrics

    def dispatch(self, session: Session, worker: WorkerProc, msg: m.FromWorker) -> None:
        events = self._events
        match msg:
            case m.Delta(turn=turn, text=text):
                if session.pending_input is not None:
                    self._ledger.streaming(session)
                if turn == session.current_turn:
                    self.metrics.delta(session)
                    events.emit(
                        session,
                        m.TextDelta(session=session.id, seq=events.next_seq(session), turn=turn, text=text),
                    )
            case m.WorkerReasoning(turn=turn, text=text):
                if turn == session.current_turn:
                    events.emit_live(
                        session,
                        m.ReasoningDelta(session=session.id, seq=events.next_seq(session), turn=turn, text=text),
                    )
            case m.Done():
                self._ledger.commit(session, worker, msg)
            case m.Failed():
                self._ledger.fail(session, msg)
            case m.WorkerSpans():
                self._ledger.worker_spans(session, msg)
            case m.WorkerNotice(turn=turn, kind=kind, data=data):
                self.metrics.notice(kind, data)
                events.emit(
                    session,
                    m.Notice(session=session.id, seq=events.next_seq(session), turn=turn, kind=kind, data=data),
                )
            case m.WorkerLimit(kind=kind, value=value, limit=limit, ceiling=ceiling, unit=unit):
                if kind == LimitKind.BUDGET and ceiling.rpartition(".")[2] in BudgetSettings.__struct_fields__:
                    self.metrics.budget_reached(ceiling)
                events.emit(
                    session,
                    m.LimitExceeded(session=session.id, seq=events.next_seq(session), kind=kind,
                                    value=value, limit=limit, ceiling=ceiling, unit=unit),
                )
            case m.Spent():
                self._ledger.spent(session, msg)
            case m.AskPermission():
                self._ledger.asked(session, msg)
            case m.SpawnAgent():
                self._spawn_task(self._subagents.run(session, worker, msg))
            case m.StepBegun() | m.StepDone():
                self._resumable.step(session, worker, msg)
