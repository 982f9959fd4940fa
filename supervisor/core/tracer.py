"""Turn traces: what the daemon's parts tell the tracer (the `Tracer`
protocol), and the tracer that does nothing (`NO_TRACER`, the default:
tracing is off unless configured).

Runs in the daemon's loop.  One trace per turn (docs/tracing.md):

    invoke_agent HANDLER               the turn: from the input's arrival to TurnDone/TurnFailed
    ├─ sessiond.queue                  arrival → the worker has the input
    │  └─ sessiond.worker.start        a hibernated session revived for it
    ├─ sessiond.input.durable          the input's append and fsync → Accepted
    ├─ chat MODEL, execute_tool NAME   recorded by the worker (WorkerSpans)
    │  └─ sessiond.subagent CHILD      spawn_agent: the child session, on its own worker
    │     └─ invoke_agent HANDLER ...  its turn
    ├─ execute_tool NAME               made here for a tool call the worker died in
    ├─ sessiond.commit.durable         Done → its append and fsync → TurnDone
    └─ sessiond.restart                the worker died during the turn: until it is back

The parts call a `Tracer` they are built with, as they call the metrics
`Recorder`: the control socket (`request`, at an input's arrival), the
ledger (`begin`, `input_durable`, `step`, `worker_lost`, `commit_started`,
`ended`), the workers' owner (`worker_spans`), the event log
(`state_changed`: restarts, worker boots), sub-agents (`subagent`) and a
resumed turn (`resumed`).
`TurnTrace` is the ledger's handle on a turn's trace (`Session.trace`).
`supervisor.ops.tracing_config.build` makes the OpenTelemetry one
(`supervisor.ops.otel`, the `otel` extra) when the config or the standard
OTEL_* variables ask for it.

The protocol lives here, with the core that calls it; `supervisor.ops`
implements it, above the core (ARCHITECTURE.md, "What each folder may
import").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ipc import messages as m
from ipc.traceparent import TraceParent

__all__ = ["NO_TRACER", "NoTracer", "SubagentTrace", "Tracer", "TurnTrace", "UntracedSubagent"]


@dataclass(slots=True, eq=False)
class TurnTrace:
    """An input on its way to becoming a turn, then the turn's trace."""

    received_ns: int  # when the input arrived (the queue span starts there)
    parent: TraceParent | None = None  # the client's span, or the spawning tool call's
    # Set by the tracer once the turn began: whether the worker records
    # spans, and the implementation's own state (its spans).
    recording: bool = False
    content: bool = False
    # The trace's id (32 hex digits) once it records: the worker passes it
    # on, as W3C trace context, to what its tools call (MCP servers).
    trace_id: str = ""
    spans: Any = None


class SubagentTrace(Protocol):
    """A sub-agent's span: its child session's turn is traced beneath it."""

    def turn(self, received_ns: int) -> TurnTrace | None: ...

    def child(self, session_id: str) -> None: ...

    def end(self, error: str = "") -> None: ...


class UntracedSubagent:
    """A sub-agent's span that records nothing."""

    def turn(self, received_ns: int) -> TurnTrace | None:
        return None

    def child(self, session_id: str) -> None:
        pass

    def end(self, error: str = "") -> None:
        pass


class Tracer(Protocol):
    """What the parts tell the tracer (`supervisor.ops.otel.OtelTracer`
    records; `NoTracer` does nothing)."""

    enabled: bool

    def request(self, parent: TraceParent | None, received_ns: int) -> TurnTrace | None:
        """An input arrived (None: not traced)."""

    def begin(self, session_id: str, turn: int, handler: str, trace: TurnTrace | None, *, text: str = "",
              owner_uid: int | None = None) -> TurnTrace | None:
        """The turn begins: its input (`text`, from the session's owner) is
        appended and sent to the worker."""

    def step(self, trace: TurnTrace, msg: m.StepBegun | m.StepDone) -> None:
        """A step of the traced turn began or ended (the ledger took it)."""

    def worker_lost(self, trace: TurnTrace, failure: str) -> None:
        """The turn's worker died (`failure`: how), and the turn is held to
        resume on the next one: what it ran died with it."""

    def input_durable(self, trace: TurnTrace, error: str = "") -> None: ...

    def commit_started(self, trace: TurnTrace) -> None: ...

    def ended(self, session_id: str, trace: TurnTrace, failed: str = "", done: m.Done | None = None) -> None:
        """TurnDone (`done`) or TurnFailed (`failed`, the reason)."""

    def worker_spans(self, trace: TurnTrace, msg: m.WorkerSpans) -> None: ...

    def state_changed(self, session_id: str, old: str, new: str, reason: str, trace: TurnTrace | None) -> None: ...

    def subagent(self, trace: TurnTrace | None, span_id: int, handler: str) -> SubagentTrace | None: ...

    def resumed(self, trace: TurnTrace | None, detail: str = "") -> None:
        """A turn goes on on a new worker from its last durable step (the
        resume path calls this once the new worker has the turn)."""

    def forget(self, session_id: str) -> None:
        """The session is gone (removed, or its create failed)."""

    def stats(self) -> dict[str, Any]: ...


class NoTracer:
    """Does nothing: tracing is off (each call returns at once, None where
    a trace would be)."""

    enabled = False

    def request(self, parent: TraceParent | None, received_ns: int) -> TurnTrace | None:
        return None

    def begin(self, session_id: str, turn: int, handler: str, trace: TurnTrace | None, *, text: str = "",
              owner_uid: int | None = None) -> TurnTrace | None:
        return None

    def subagent(self, trace: TurnTrace | None, span_id: int, handler: str) -> SubagentTrace | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def _nothing(self, *args: object, **kwargs: object) -> None:
        pass

    # The calls that only tell: nothing to do with what they say.
    step = worker_lost = input_durable = commit_started = ended = worker_spans = state_changed = _nothing
    resumed = forget = _nothing


NO_TRACER: Tracer = NoTracer()
