"""What the daemon's parts count: the `Recorder` protocol, and the recorder
that counts nothing (`NO_METRICS`, the default: `[daemon] metrics_listen`
is empty unless configured).

Runs in the daemon's loop.  The parts (WorkerOwner, TurnLedger, Sweeper,
Budgets, the control server) call the recorder they are built with; with
metrics off each call is one empty method.  The protocol lives here, with
the core that calls it; `supervisor.ops.metrics.PrometheusRecorder`
implements it, above the core (ARCHITECTURE.md, "What each folder may
import"), and `prometheus_client` is imported only there.
"""

from __future__ import annotations

from typing import Any, Protocol

from supervisor.core.session import Session

__all__ = ["NO_METRICS", "NoMetrics", "Recorder"]


class Recorder(Protocol):
    """The calls the parts make."""

    def worker_exit(self, reason: str) -> None: ...

    def restart(self) -> None: ...

    def turn_started(self, session: Session) -> None: ...

    def delta(self, session: Session) -> None:
        """A piece of reply text of the running turn (time to first token)."""

    def turn_ended(self, session: Session, done: bool, reason: str, secs: float) -> None: ...

    def commit(self, secs: float, records: int = 1) -> None:
        """One durable append (write + fsync) of `records` records.  A group
        commit passes the size of its batch."""

    def sweep(self, secs: float) -> None: ...

    def loop_stall(self, secs: float) -> None: ...

    def worker_starved(self) -> None:
        """A silent worker was found waiting for a CPU and let live
        (supervisor.core.silence)."""

    def request(self, kind: str, code: str) -> None: ...

    def notice(self, kind: str, data: dict[str, Any]) -> None:
        """A worker's notice (provider retries are counted by HTTP status)."""

    def llm_spent(self, spend: dict[str, int]) -> None:
        """More LLM calls and tokens spent by a running turn (ipc.budget's keys)."""

    def budget_reached(self, ceiling: str) -> None:
        """A turn ended at an [agent.budget] ceiling (its config key)."""


class NoMetrics:
    """Metrics off: every call returns at once."""

    def _nothing(self, *args: object, **kwargs: object) -> None:
        pass

    worker_exit = restart = turn_started = delta = turn_ended = commit = sweep = loop_stall = _nothing
    worker_starved = _nothing
    request = notice = llm_spent = budget_reached = _nothing


NO_METRICS: Recorder = NoMetrics()
