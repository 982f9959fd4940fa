"""What a running turn carries besides its text, nested in the worker
protocol's messages (ipc/messages.py re-exports them: `m.Resumed`): the
steps a resumed turn starts from, and the spans a traced turn's worker
records.  Plain structs, no tag of their own: the daemon and the worker
both read them."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["StepResult", "StepInFlight", "Resumed", "SpanEvent", "SpanRecord"]


class StepResult(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A step of the running turn, as journaled: `ctx.step(key, ...)`'s result."""

    key: str
    result: bytes  # msgpack of the value the step returned
    # The step's number: the order in which the turn started its steps
    # (-1: its place in `Resumed.steps`, as before steps could overlap).
    n: int = -1


class StepInFlight(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """A step of the running turn that had begun and not ended when its
    worker died (docs/agent.md, "Durable steps")."""

    n: int
    key: str


class Resumed(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """The turn's worker died during it: this is the same turn again, with
    the steps it made durable (docs/agent.md, "Durable steps")."""

    reason: str  # the exit reason (ipc.contract.ExitReason), or "daemon_stopped"
    cause: str  # e.g. "memory cap of 64 MiB reached", "the worker crashed (signal SIGKILL)"
    step: int  # the lowest step number not ended: steps 0..step-1 are journaled (or failed)
    # The key of the lowest-numbered step in flight when the worker died ("" = none was).
    running: str = ""
    # True after a daemon restart: whether the steps in flight had begun is
    # not known; with none in flight, step `step` may have begun.
    uncertain: bool = False
    steps: list[StepResult] = []  # the journaled results, by number
    in_flight: list[StepInFlight] = []  # every step that had begun and not ended, by number


class SpanEvent(msgspec.Struct, omit_defaults=True, kw_only=True):
    name: str
    at_ns: int
    attributes: dict[str, Any] = {}


class SpanRecord(msgspec.Struct, omit_defaults=True, kw_only=True):
    """One finished span of a traced turn, recorded in the worker.  The
    daemon checks it as untrusted data (sizes, counts, times) and places
    it in the turn's trace."""

    id: int  # 64-bit span id, chosen by the worker, not 0
    parent: int = 0  # a span of this worker's, or 0: the turn's own span
    name: str
    kind: int = 0  # OpenTelemetry SpanKind: 0 internal, 2 client
    start_ns: int  # unix time, ns
    end_ns: int
    error: str = ""  # not "": the span failed, and why
    attributes: dict[str, Any] = {}
    events: list[SpanEvent] = []
