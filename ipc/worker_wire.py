"""The worker link: what the daemon and a session's worker say to each other
over their socketpair, as tagged msgspec Structs (the same framing and the
same schema rules as the control link, ipc.messages).

    daemon  --ToWorker-->   worker     Boot, Input, StepSaved, answers, stop
    daemon  <--FromWorker-- worker     Ready, deltas, steps, Done, heartbeats

Beside them, the plain structs a running turn carries nested in them (no tag
of their own): the steps a resumed turn starts from (`Resumed`), the spans a
traced turn's worker records (`WorkerSpans.spans`).  ipc.messages re-exports
every name here (`m.Boot`), the face both sides import.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ipc.wirebase import Msg

__all__ = [
    # nested in worker messages
    "StepResult", "StepInFlight", "Resumed", "SpanEvent", "SpanRecord",
    # daemon -> worker
    "Boot", "SandboxBoot", "Input", "InterruptTurn", "WorkerPing", "Shutdown", "PermissionAnswer",
    "SpawnResult", "MemoryHigh", "Reconfigure", "StepSaved", "BudgetUpdate", "CallCleared", "ToWorker",
    # worker -> daemon
    "Ready", "BootFailed", "Delta", "WorkerReasoning", "WorkerNotice", "WorkerLimit", "Spent", "Done",
    "Failed", "Heartbeat", "WorkerPong", "AskPermission", "SpawnAgent", "StepBegun", "StepDone",
    "WorkerSpans", "FromWorker",
]


# ---------------------------------------------------------------- nested in worker messages


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


# ---------------------------------------------------------------- daemon -> worker


class SandboxBoot(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    """What the daemon found at start about confining tools on this host."""

    # bubblewrap can set up namespaces for a session's uid (probed at start).
    namespaces: bool = False
    bwrap: str = ""
    why_not: str = ""  # why not, when namespaces is False
    landlock_abi: int = 0
    # Daemon paths no tool may see even under a read-only system tree
    # (its config, state and socket directories).
    hide: list[str] = []
    # Why the daemon cannot hold sessions to max_memory_mb and max_processes
    # (it cannot read its workers' /proc entries: hidepid; and no cgroup
    # counts them instead); tools then do not run.  '' when it can.
    unmeasured: str = ""


class Boot(Msg, tag="boot"):
    session: str
    handler: str
    settings: bytes  # msgpack of session_worker.settings.SessionSettings
    workspace: str
    depth: int = 0
    turns: int = 0  # committed turns so far
    snapshot: bytes = b""  # msgpack of the handler's state; empty = none
    records: list[bytes] = []  # turn records committed after the snapshot
    # Drop to these ids before any handler code runs (daemon running as root).
    run_as_uid: int | None = None
    run_as_gid: int | None = None
    sandbox: SandboxBoot | None = None  # None: tools run unconfined (sandbox.mode = off)


class Input(Msg, tag="input"):
    turn: int
    text: str
    resumed: Resumed | None = None
    # The turn is traced: record spans (LLM calls, tool calls) and send
    # them as `WorkerSpans`.  The worker learns no collector: the daemon
    # places its spans in the turn's trace and alone exports them.
    trace: bool = False
    # With `trace`: prompts and completions go into the LLM call spans.
    trace_content: bool = False
    # With `trace`: the trace's id (32 hex digits), which the worker passes
    # on as W3C trace context (`traceparent`) to the MCP servers its tools
    # call; its own spans still go to the daemon, which places them.
    trace_id: str = ""
    # What counts against the session's [agent.budget] ceilings besides
    # the turn's own calls (ipc.budget): the session's turns before this
    # one, and the other sessions of its uid (sent only with a uid ceiling).
    spent: dict[str, int] = {}
    uid_spent: dict[str, int] = {}


class StepSaved(Msg, tag="step_saved"):
    """Step `n` of the turn is durable (or, with `error`, will never be);
    with `begun`, its start (a `StepBegun` that asked `durable`) is."""

    turn: int
    n: int
    error: str = ""
    begun: bool = False


class BudgetUpdate(Msg, tag="budget"):
    """Other sessions of the uid spent more while this turn runs: their
    total now (Input.uid_spent), for the next check of a uid ceiling."""

    turn: int
    uid_spent: dict[str, int] = {}


class InterruptTurn(Msg, tag="interrupt"):
    turn: int


class WorkerPing(Msg, tag="ping"):
    nonce: int


class Shutdown(Msg, tag="shutdown"):
    pass


class PermissionAnswer(Msg, tag="permission_answer"):
    request_id: str
    allow: bool


class SpawnResult(Msg, tag="spawn_result"):
    request_id: str
    ok: bool
    reply: str = ""
    reason: str = ""


class MemoryHigh(Msg, tag="memory_high"):
    rss_bytes: int
    limit_bytes: int


class Reconfigure(Msg, tag="reconfigure"):
    """The config was reloaded: the session's new effective settings."""

    settings: bytes  # msgpack of session_worker.settings.SessionSettings


class CallCleared(Msg, tag="call_cleared"):
    """The answer to a `Spent` with a `request_id`: the call is counted and
    may be made (no `ceiling`, no `error`); or a ceiling leaves no room
    for it (as `LimitExceeded`'s fields; `unknown`: a session ceiling of a
    session imported without its figures); or it could not be counted
    (`error`: the ledger could not be written) and is not made."""

    request_id: str
    ceiling: str = ""
    used: int = 0
    limit: int = 0
    unit: str = ""
    unknown: bool = False
    error: str = ""


ToWorker = (
    Boot | Input | InterruptTurn | WorkerPing | Shutdown | PermissionAnswer | SpawnResult
    | MemoryHigh | Reconfigure | StepSaved | BudgetUpdate | CallCleared
)


# ---------------------------------------------------------------- worker -> daemon


class Ready(Msg, tag="ready"):
    pid: int
    # What confines this session's tools: {"active": [...], "inactive":
    # {mechanism: why}, "network": policy}; empty with sandbox.mode = off.
    sandbox: dict[str, Any] = {}
    # The handler marks its work with `ctx.step` (the agent does): a turn
    # its worker dies in is resumed even before its first step is journaled.
    uses_steps: bool = False


class BootFailed(Msg, tag="boot_failed"):
    reason: str


class Delta(Msg, tag="delta"):
    turn: int
    text: str


class WorkerReasoning(Msg, tag="reasoning"):
    turn: int
    text: str


class WorkerNotice(Msg, tag="notice"):
    turn: int
    kind: str
    data: dict[str, Any] = {}


class WorkerLimit(Msg, tag="limit"):
    turn: int
    kind: str
    value: float
    limit: float
    ceiling: str = ""  # as LimitExceeded's
    unit: str = ""


class Spent(Msg, tag="spent"):
    """After each LLM call: what the running turn spent so far (usage keys
    plus `llm_calls`; cumulative, so a repeat or a resumed turn's replay
    never counts twice).  The daemon counts it against the uid's ceilings
    at once, and, should the turn not commit, into the session's.

    With `request_id`: an LLM call is about to be made (`spend` unused).
    The daemon checks the ceilings, counts the call in its spend ledger
    durably and answers `CallCleared`; the request goes out only then, so
    a worker killed during the call has already paid for it."""

    turn: int
    spend: dict[str, int] = {}
    request_id: str = ""


class Done(Msg, tag="done"):
    turn: int
    reply: str
    record: bytes = b""  # msgpack of the handler's record for this turn
    interrupted: bool = False
    snapshot: bytes = b""  # when non-empty: the handler's whole state after this turn
    stop_reason: str = ""  # as TurnDone.stop_reason
    stop_detail: str = ""
    usage: dict[str, int] = {}  # as TurnDone.usage


class Failed(Msg, tag="failed"):
    turn: int
    reason: str
    record: bytes = b""


class Heartbeat(Msg, tag="hb"):
    pass


class WorkerPong(Msg, tag="pong"):
    nonce: int


class AskPermission(Msg, tag="ask"):
    turn: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = {}


class SpawnAgent(Msg, tag="spawn"):
    turn: int
    request_id: str
    task: str
    handler: str | None = None
    # The worker's span this spawn runs under (its spawn_agent tool call),
    # when the turn is traced: the child's turn is traced beneath it.
    span: int = 0


class WorkerSpans(Msg, tag="spans"):
    turn: int
    spans: list[SpanRecord] = []


class StepBegun(Msg, tag="step_begun"):
    """Step `n` starts running: journaled (a `StepStart` record, with the
    next flush), so that the daemon knows which steps were in flight if the
    worker, or the daemon, dies now."""

    turn: int
    n: int
    key: str
    kind: str = ""
    # Answer `StepSaved(begun=True)` once this start is durable: the worker
    # runs the step only then (another step was in flight or not yet durable).
    durable: bool = False


class StepDone(Msg, tag="step"):
    """Step `n`'s result, to journal; answered with `StepSaved`."""

    turn: int
    n: int
    key: str
    kind: str = ""  # "llm", "tool", or the handler's own word
    result: bytes = b""
    # The step ended without a result (its function raised, or the call
    # was cancelled before it ran): journaled so that its number is closed;
    # a resumed turn runs it again.
    failed: bool = False


FromWorker = (
    Ready | BootFailed | Delta | WorkerReasoning | WorkerNotice | WorkerLimit | Done | Failed | Heartbeat
    | WorkerPong | AskPermission | SpawnAgent | StepBegun | StepDone | WorkerSpans | Spent
)
