"""Every message sessiond puts on a socket, as tagged msgspec Structs.

Three links, each with one union per direction (the zygote's in
ipc/zygote_wire.py):

    client  --Request-->   daemon  --ToWorker-->   worker
    client  <--Reply---    daemon  <--FromWorker-- worker
                           daemon  --ToZygote-->   zygote
                           daemon  <--FromZygote-- zygote

Rules (schema evolution, as msgspec documents it): the `tag=` string is the
wire name and never changes with a class rename; a new field always gets a
default; a field's type never changes.  Maps, not arrays, so that any msgpack
client in any language can read a frame without our source.

Requests carry a client-chosen `id`; the reply to a request echoes it (a
result struct or `Error`).  Events carry `session` and that session's `seq`,
which is monotonic for the life of the session, across worker restarts and
daemon restarts, so a client can re-`Attach` from the last seq it saw.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

# Nested in worker messages (Input.resumed, WorkerSpans.spans): kept apart.
from ipc.turn_wire import Resumed, SpanEvent, SpanRecord, StepResult

__all__ = [
    "PROTOCOL_VERSION",
    # client -> daemon
    "Hello", "Create", "Send", "Attach", "Detach", "Interrupt", "Stop", "Restart",
    "Remove", "Status", "List", "Stats", "Ping", "Answer", "Repair", "Request",
    "NEW_ERROR_CODES",
    # daemon -> client
    "Welcome", "Error", "ErrorCode", "Ok", "Created", "Accepted", "Attached",
    "StatusReply", "SessionList", "StatsReply", "Pong", "Repaired", "ExitInfo", "Waiting", "SessionInfo",
    "TextDelta", "ReasoningDelta", "TurnDone", "TurnFailed", "StateChanged", "LimitExceeded", "Notice",
    "PermissionRequest", "Gap", "Lagged", "Event", "Reply", "EVENT_TYPES",
    # daemon <-> worker
    "Boot", "SandboxBoot", "Input", "InterruptTurn", "WorkerPing", "Shutdown", "PermissionAnswer",
    "SpawnResult", "MemoryHigh", "Reconfigure", "StepResult", "Resumed", "StepSaved", "BudgetUpdate", "ToWorker",
    "Ready", "BootFailed", "Delta", "WorkerNotice", "WorkerLimit", "Spent", "Done", "Failed",
    "Heartbeat", "WorkerPong", "AskPermission", "SpawnAgent", "StepBegun", "StepDone", "SpanEvent",
    "SpanRecord", "WorkerSpans", "FromWorker",
    # daemon <-> zygote: ipc/zygote_wire.py
    # added after protocol 1 (history, logs, export/import, top)
]

PROTOCOL_VERSION = 1


class _Msg(msgspec.Struct, tag_field="type", omit_defaults=True, kw_only=True, gc=False):
    """Every message is data (scalars, strings, lists and dicts of them),
    never part of a reference cycle, so none is tracked by the cyclic
    garbage collector (`gc=False`, inherited).  The daemon keeps tens of
    thousands of events for replay (`event_retention_bytes`): tracked, each
    full collection walked every one of them, 11-18 ms with 50 busy sessions,
    the whole of the control plane's p99 (bench/load.py)."""


class ErrorCode(enum.StrEnum):
    NOT_FOUND = "not_found"
    BAD_REQUEST = "bad_request"
    CAPACITY = "capacity"
    LIMIT_EXCEEDED = "limit_exceeded"
    PERMISSION_DENIED = "permission_denied"
    CONFLICT = "conflict"
    PROTOCOL_MISMATCH = "protocol_mismatch"
    INTERNAL = "internal"
    # The state directory's disk (or quota, or file size limit) is full:
    # nothing was saved; free space and retry.
    NO_SPACE = "no_space"


# Codes added after protocol 1 shipped.  A client decodes `Error.code` as
# this enum, and msgspec rejects a value it does not know (the whole frame
# fails to decode), so these are sent only to clients that list them in
# `Hello.error_codes`; older clients get `internal` with the same message.
NEW_ERROR_CODES = frozenset({ErrorCode.NO_SPACE})

# Event tags added after protocol 1 shipped.  A client decodes events as a
# tagged union, and msgspec rejects a tag it does not know (the frame fails
# to decode and the client drops the connection), so these are delivered
# only to clients that list them in `Hello.events`; others never see them.
NEW_EVENT_TAGS = frozenset({"reasoning"})


# ---------------------------------------------------------------- client -> daemon


class Hello(_Msg, tag="hello"):
    protocol: int
    client: str = ""
    # Error codes of NEW_ERROR_CODES this client can decode.
    error_codes: list[str] = []
    # Event tags of NEW_EVENT_TAGS this client wants (and can decode).
    events: list[str] = []


class Create(_Msg, tag="create"):
    id: int
    session: str | None = None  # chosen id; None = the daemon picks one
    handler: str | None = None  # None = [agent] handler from the config
    # Dotted config keys under agent./provider./tools. with typed values.
    settings: dict[str, Any] = {}


class Send(_Msg, tag="send"):
    """An input.  Replied to with `Accepted` once the input is durable; the
    turn's events then follow on this connection (it is attached)."""

    id: int
    session: str
    text: str
    # W3C `traceparent` of the caller's span (ipc.traceparent): the turn's
    # trace continues it.  "" = a trace of its own (when tracing is on).
    traceparent: str = ""


class Attach(_Msg, tag="attach"):
    id: int
    session: str
    # Replay retained events with seq >= from_seq first; None = live only.
    from_seq: int | None = None


class Detach(_Msg, tag="detach"):
    id: int
    session: str


class Interrupt(_Msg, tag="interrupt"):
    id: int
    session: str


class Stop(_Msg, tag="stop"):
    id: int
    session: str


class Restart(_Msg, tag="restart"):
    id: int
    session: str


class Remove(_Msg, tag="rm"):
    id: int
    session: str


class Status(_Msg, tag="status"):
    id: int
    session: str


class List(_Msg, tag="ls"):
    id: int


class Stats(_Msg, tag="stats"):
    id: int


class Ping(_Msg, tag="ping"):
    """Without a session: the daemon answers.  With one: the round trip goes
    through that session's worker (which must be live)."""

    id: int
    session: str | None = None


class Answer(_Msg, tag="answer"):
    """Approve or deny a pending `PermissionRequest`."""

    id: int
    session: str
    request_id: str
    allow: bool


class Repair(_Msg, tag="repair"):
    """Rewrite a damaged session's log so that it loads again.  `mode`:
    "skip_bad" keeps every intact record, "truncate" what precedes the
    first damaged one.  Replied to with `Repaired`."""

    id: int
    session: str
    mode: str


Request = (
    Hello | Create | Send | Attach | Detach | Interrupt | Stop | Restart | Remove
    | Status | List | Stats | Ping | Answer | Repair
)


# ---------------------------------------------------------------- daemon -> client


class Welcome(_Msg, tag="welcome"):
    protocol: int
    server_version: str
    pid: int


class Error(_Msg, tag="error"):
    code: ErrorCode
    message: str
    id: int = 0  # 0 when the error answers no request (a bad frame)


class Ok(_Msg, tag="ok"):
    id: int


class ExitInfo(_Msg, tag="exit"):
    # exited, boot_failed, crashed, killed_memory, killed_turn_timeout,
    # killed_heartbeat, killed_processes, killed_disk (the session is then
    # stopped, not restarted), stopped
    reason: str
    code: int | None = None
    signal: int | None = None
    at: float = 0.0  # unix time
    detail: str = ""


class Waiting(_Msg, tag="waiting"):
    """A permission request of the session's running turn that waits on a
    person (`Answer` settles it): what `SessionInfo.waiting` lists."""

    request_id: str
    tool: str
    since: float = 0.0  # unix time it was asked
    turn: int = 0
    seq: int = 0  # its PermissionRequest event's (an Attach from here replays it)


class SessionInfo(_Msg, tag="session"):
    id: str
    state: str
    handler: str
    pid: int | None = None
    rss_bytes: int | None = None
    restarts: int = 0
    turns: int = 0
    created_at: float = 0.0
    last_exit: ExitInfo | None = None
    seq: int = 0
    parent: str | None = None
    children: list[str] = []
    owner_uid: int = 0
    # Why the session is "damaged" (its stored state failed to load), or
    # "stopped" because another daemon took it over; None otherwise.
    error: str | None = None
    # Token totals of the session's committed turns (TurnDone.usage summed).
    usage: dict[str, int] = {}
    # The live worker's sandbox, as its Ready reported it (see Ready.sandbox).
    sandbox: dict[str, Any] = {}
    # Cluster mode: the address of the node its worker runs on, as Ray
    # reports it (pid is then that node's); None on one machine or unplaced.
    node: str | None = None
    # Blocks its workspace held at the sweep's last walk of it (max_disk_mb);
    # None when not measured (no quota, or no walk since its worker started).
    disk_bytes: int | None = None
    # Its worker tree's CPU use (user + system, % of one core) between the
    # sweep's two last samples, about a second apart; None without a live
    # worker or before the second sample.
    cpu_percent: float | None = None
    # Its [agent.budget] figures: {"spent": by measure (its turns and the
    # running one), "turn": the running turn's, "ceilings": [{"ceiling",
    # "used", "limit", "unit"}, ...] for each ceiling set; with a uid
    # ceiling also "uid_spent"}.  Empty for a session no daemon holds here.
    budget: dict[str, Any] = {}
    # Its running turn waits on a person: the permission requests not yet
    # answered, oldest first.  (Its state stays "running".)
    waiting: list[Waiting] = []


class Created(_Msg, tag="created"):
    id: int
    session: SessionInfo


class Accepted(_Msg, tag="accepted"):
    id: int
    session: str
    turn: int
    seq: int  # the events of this turn have seq > this


class Attached(_Msg, tag="attached"):
    id: int
    session: str
    next_seq: int


class StatusReply(_Msg, tag="status"):
    id: int
    session: SessionInfo


class SessionList(_Msg, tag="sessions"):
    id: int
    sessions: list[SessionInfo]


class StatsReply(_Msg, tag="stats"):
    id: int
    pid: int
    version: str
    uptime_secs: float
    sessions: int
    by_state: dict[str, int]
    live_workers: int
    clients: int
    rss_bytes: int
    # What confines sessions on this host: {"mode", "namespaces",
    # "landlock_abi", "seccomp", "cgroups", and "why_not" per missing one}.
    sandbox: dict[str, Any] = {}
    # OpenTelemetry export when on (and the asker is an admin): {"exporter",
    # "endpoint", "spans" (made), "dropped", "queued", "exporting",
    # "exported", "failed"}; empty when tracing is off.
    tracing: dict[str, Any] = {}


class Pong(_Msg, tag="pong"):
    id: int
    session: str | None = None
    pid: int = 0  # the daemon's, or the worker's for a session ping


class Repaired(_Msg, tag="repaired"):
    id: int
    session: SessionInfo
    kept_records: int = 0
    dropped_records: int = 0  # intact records dropped (truncate)
    dropped_bytes: int = 0  # damaged bytes dropped


# Events: every one has session and seq.


class TextDelta(_Msg, tag="text"):
    session: str
    seq: int
    turn: int
    text: str


class ReasoningDelta(_Msg, tag="reasoning"):
    """A piece of the model's reasoning (DeepSeek/Kimi `reasoning_content`,
    Anthropic thinking): not reply text, for clients to show or hide.  Sent
    only to clients that announced "reasoning" in `Hello.events`, and only
    live: not retained for `Attach{from_seq}` (thinking can be far longer
    than the reply and would push the events that matter out of the
    retained window), so a replay skips its seq numbers."""

    session: str
    seq: int
    turn: int
    text: str


class TurnDone(_Msg, tag="turn_done"):
    session: str
    seq: int
    turn: int
    reply: str
    interrupted: bool = False
    # ipc.contract.StopReason as a plain string ("" = complete), so a value
    # added later never makes an old client fail to decode the frame.
    stop_reason: str = ""
    # The provider's own word for it (e.g. "length", "max_tokens").
    stop_detail: str = ""
    # Tokens the turn's LLM calls spent, as the provider counted them:
    # prompt_tokens, completion_tokens, reasoning_tokens (those of them it reported).
    usage: dict[str, int] = {}


class TurnFailed(_Msg, tag="turn_failed"):
    session: str
    seq: int
    turn: int
    reason: str


class StateChanged(_Msg, tag="state"):
    session: str
    seq: int
    old: str
    new: str
    reason: str = ""


class LimitExceeded(_Msg, tag="limit"):
    session: str
    seq: int
    kind: str  # memory, memory_high, turn_timeout, heartbeat, turns, restarts, budget...
    value: float
    limit: float
    # kind "budget": which ceiling (its config key) and the unit of value and limit.
    ceiling: str = ""
    unit: str = ""


class Notice(_Msg, tag="notice"):
    session: str
    seq: int
    turn: int
    kind: str
    data: dict[str, Any] = {}


class PermissionRequest(_Msg, tag="permission_request"):
    session: str
    seq: int
    turn: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = {}


class Gap(_Msg, tag="gap"):
    """Attach asked for events no longer retained; `seq` is the first one
    that will follow."""

    session: str
    seq: int
    from_seq: int


class Lagged(_Msg, tag="lagged"):
    """This client fell `dropped` frames behind and is being disconnected;
    the session is unaffected.  Re-attach with `from_seq` to catch up."""

    session: str = ""
    seq: int = 0
    dropped: int = 0


Event = (
    TextDelta | ReasoningDelta | TurnDone | TurnFailed | StateChanged | LimitExceeded | Notice
    | PermissionRequest | Gap | Lagged
)
EVENT_TYPES = (
    TextDelta, ReasoningDelta, TurnDone, TurnFailed, StateChanged, LimitExceeded, Notice,
    PermissionRequest, Gap, Lagged,
)

Reply = (
    Welcome | Error | Ok | Created | Accepted | Attached | StatusReply | SessionList
    | StatsReply | Pong | Repaired | TextDelta | ReasoningDelta | TurnDone | TurnFailed | StateChanged
    | LimitExceeded | Notice | PermissionRequest | Gap | Lagged
)


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


class Boot(_Msg, tag="boot"):
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


class Input(_Msg, tag="input"):
    turn: int
    text: str
    resumed: Resumed | None = None
    # The turn is traced: record spans (LLM calls, tool calls) and send
    # them as `WorkerSpans`.  The worker learns no trace id and no
    # collector: the daemon places its spans and alone exports them.
    trace: bool = False
    # With `trace`: prompts and completions go into the LLM call spans.
    trace_content: bool = False
    # What counts against the session's [agent.budget] ceilings besides
    # the turn's own calls (ipc.budget): the session's turns before this
    # one, and the other sessions of its uid (sent only with a uid ceiling).
    spent: dict[str, int] = {}
    uid_spent: dict[str, int] = {}


class StepSaved(_Msg, tag="step_saved"):
    """Step `n` of the turn is durable (or, with `error`, will never be)."""

    turn: int
    n: int
    error: str = ""


class BudgetUpdate(_Msg, tag="budget"):
    """Other sessions of the uid spent more while this turn runs: their
    total now (Input.uid_spent), for the next check of a uid ceiling."""

    turn: int
    uid_spent: dict[str, int] = {}


class InterruptTurn(_Msg, tag="interrupt"):
    turn: int


class WorkerPing(_Msg, tag="ping"):
    nonce: int


class Shutdown(_Msg, tag="shutdown"):
    pass


class PermissionAnswer(_Msg, tag="permission_answer"):
    request_id: str
    allow: bool


class SpawnResult(_Msg, tag="spawn_result"):
    request_id: str
    ok: bool
    reply: str = ""
    reason: str = ""


class MemoryHigh(_Msg, tag="memory_high"):
    rss_bytes: int
    limit_bytes: int


class Reconfigure(_Msg, tag="reconfigure"):
    """The config was reloaded: the session's new effective settings."""

    settings: bytes  # msgpack of session_worker.settings.SessionSettings


ToWorker = (
    Boot | Input | InterruptTurn | WorkerPing | Shutdown | PermissionAnswer | SpawnResult
    | MemoryHigh | Reconfigure | StepSaved | BudgetUpdate
)


# ---------------------------------------------------------------- worker -> daemon


class Ready(_Msg, tag="ready"):
    pid: int
    # What confines this session's tools: {"active": [...], "inactive":
    # {mechanism: why}, "network": policy}; empty with sandbox.mode = off.
    sandbox: dict[str, Any] = {}
    # The handler marks its work with `ctx.step` (the agent does): a turn
    # its worker dies in is resumed even before its first step is journaled.
    uses_steps: bool = False


class BootFailed(_Msg, tag="boot_failed"):
    reason: str


class Delta(_Msg, tag="delta"):
    turn: int
    text: str


class WorkerReasoning(_Msg, tag="reasoning"):
    turn: int
    text: str


class WorkerNotice(_Msg, tag="notice"):
    turn: int
    kind: str
    data: dict[str, Any] = {}


class WorkerLimit(_Msg, tag="limit"):
    turn: int
    kind: str
    value: float
    limit: float
    ceiling: str = ""  # as LimitExceeded's
    unit: str = ""


class Spent(_Msg, tag="spent"):
    """After each LLM call: what the running turn spent so far (usage keys
    plus `llm_calls`; cumulative, so a repeat or a resumed turn's replay
    never counts twice).  The daemon counts it against the uid's ceilings
    at once, and, should the turn not commit, into the session's."""

    turn: int
    spend: dict[str, int] = {}


class Done(_Msg, tag="done"):
    turn: int
    reply: str
    record: bytes = b""  # msgpack of the handler's record for this turn
    interrupted: bool = False
    snapshot: bytes = b""  # when non-empty: the handler's whole state after this turn
    stop_reason: str = ""  # as TurnDone.stop_reason
    stop_detail: str = ""
    usage: dict[str, int] = {}  # as TurnDone.usage


class Failed(_Msg, tag="failed"):
    turn: int
    reason: str
    record: bytes = b""


class Heartbeat(_Msg, tag="hb"):
    pass


class WorkerPong(_Msg, tag="pong"):
    nonce: int


class AskPermission(_Msg, tag="ask"):
    turn: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = {}


class SpawnAgent(_Msg, tag="spawn"):
    turn: int
    request_id: str
    task: str
    handler: str | None = None
    # The worker's span this spawn runs under (its spawn_agent tool call),
    # when the turn is traced: the child's turn is traced beneath it.
    span: int = 0


class WorkerSpans(_Msg, tag="spans"):
    turn: int
    spans: list[SpanRecord] = []


class StepBegun(_Msg, tag="step_begun"):
    """Step `n` starts running (not journaled: tells the daemon which step
    was in flight if the worker dies now)."""

    turn: int
    n: int
    key: str
    kind: str = ""


class StepDone(_Msg, tag="step"):
    """Step `n`'s result, to journal; answered with `StepSaved`."""

    turn: int
    n: int
    key: str
    kind: str = ""  # "llm", "tool", or the handler's own word
    result: bytes = b""


FromWorker = (
    Ready | BootFailed | Delta | WorkerReasoning | WorkerNotice | WorkerLimit | Done | Failed | Heartbeat
    | WorkerPong | AskPermission | SpawnAgent | StepBegun | StepDone | WorkerSpans | Spent
)
