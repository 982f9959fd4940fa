"""Each turn's timeout: `turn_timeout_secs` from the turn's start, then an
interrupt, then, if the handler ignores it for `stop_grace_secs`, a kill.

Runs in the daemon's loop.  The turn ledger arms the timer when a turn
begins (or a held turn resumes on a new worker) and disarms it when the
turn ends, through the `on_turn_started` / `on_turn_ended` the manager
builds it with; a reload retimes a running turn (`retime_turn`).  The
deadline is the pure `supervisor.core.limits.turn_deadline_left`; the kill
goes through `WorkerOwner.kill`, the one kill path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ipc import messages as m
from ipc.contract import ExitReason, LimitKind
from supervisor.config import Config
from supervisor.core.events import EventLog
from supervisor.core.limits import turn_deadline_left
from supervisor.core.session import Session, WorkerProc
from supervisor.core.states import State, Trigger
from supervisor.core.workers import WorkerOwner

__all__ = ["TurnTimer"]


class TurnTimer:
    def __init__(self, config: Callable[[], Config], events: EventLog, workers: WorkerOwner) -> None:
        self._config = config
        self._events = events
        self._workers = workers

    def arm_turn_timer(self, session: Session, turn: int) -> None:
        if session.worker is not None:
            # The worker goes to the full pace on its input (its next beat
            # one interval after it); the shorter allowance counts from now.
            self._workers.heard_from(session.worker, time.monotonic())
        session.turn_timer = asyncio.get_running_loop().call_later(
            session.settings.agent.turn_timeout_secs, self._on_turn_timeout, session, turn
        )

    def disarm_turn(self, session: Session) -> None:
        """The turn ended: its timeout and its kill are off."""
        for timer in (session.turn_timer, session.kill_timer):
            if timer is not None:
                timer.cancel()
        session.turn_timer = session.kill_timer = None

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
