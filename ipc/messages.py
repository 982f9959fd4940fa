"""Every message sessiond puts on a socket, as tagged msgspec Structs: the
face every side imports.  The control link (a client and the daemon) is
defined here, an operator's further requests in ipc/operator.py, the worker
link in ipc/worker_wire.py (its names re-exported here), the zygote's in
ipc/zygote_wire.py; each link has one union per direction:

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

from ipc.wirebase import Msg
# The worker link's messages, defined by link in ipc.worker_wire; named here
# too (`m.Boot`), the one face every side imports.
from ipc.worker_wire import (
    AskPermission, Boot, BootFailed, BudgetUpdate, CallCleared, Delta, Done, Failed, FromWorker, Heartbeat, Input,
    InterruptTurn, MemoryHigh, PermissionAnswer, Ready, Reconfigure, Resumed, SandboxBoot, Shutdown, SpanEvent,
    SpanRecord, SpawnAgent, SpawnResult, Spent, StepBegun, StepDone, StepInFlight, StepResult, StepSaved,
    ToWorker, WorkerLimit, WorkerNotice, WorkerPing, WorkerPong, WorkerReasoning, WorkerSpans,
)

__all__ = [
    "PROTOCOL_VERSION",
    # client -> daemon
    "Hello", "Create", "Send", "Attach", "Detach", "Interrupt", "Stop", "Restart",
    "Remove", "Status", "List", "Stats", "Ping", "Answer", "Repair", "Request",
    "NEW_ERROR_CODES",
    # daemon -> client
    "Welcome", "Error", "ErrorCode", "Ok", "Created", "Accepted", "Attached",
    "StatusReply", "SessionList", "StatsReply", "Pong", "Repaired", "ExitInfo", "Waiting", "SessionInfo", "Loading",
    "TextDelta", "ReasoningDelta", "TurnDone", "TurnFailed", "StateChanged", "LimitExceeded", "Notice",
    "PermissionRequest", "Gap", "Lagged", "Event", "Reply", "EVENT_TYPES",
    # daemon <-> worker (defined in ipc.worker_wire)
    "Boot", "SandboxBoot", "Input", "InterruptTurn", "WorkerPing", "Shutdown", "PermissionAnswer",
    "SpawnResult", "MemoryHigh", "Reconfigure", "StepResult", "StepInFlight", "Resumed", "StepSaved",
    "BudgetUpdate", "CallCleared", "ToWorker",
    "Ready", "BootFailed", "Delta", "WorkerReasoning", "WorkerNotice", "WorkerLimit", "Spent", "Done", "Failed",
    "Heartbeat", "WorkerPong", "AskPermission", "SpawnAgent", "StepBegun", "StepDone", "SpanEvent",
    "SpanRecord", "WorkerSpans", "FromWorker",
    # daemon <-> zygote: ipc/zygote_wire.py; an operator's requests: ipc/operator.py
    "Msg",
]

PROTOCOL_VERSION = 1


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


class Hello(Msg, tag="hello"):
    protocol: int
    client: str = ""
    # Error codes of NEW_ERROR_CODES this client can decode.
    error_codes: list[str] = []
    # Event tags of NEW_EVENT_TAGS this client wants (and can decode).
    events: list[str] = []


class Create(Msg, tag="create"):
    id: int
    session: str | None = None  # chosen id; None = the daemon picks one
    handler: str | None = None  # None = [agent] handler from the config
    # Dotted config keys under agent./provider./tools. with typed values.
    settings: dict[str, Any] = {}


class Send(Msg, tag="send"):
    """An input.  Replied to with `Accepted` once the input is durable; the
    turn's events then follow on this connection (it is attached)."""

    id: int
    session: str
    text: str
    # W3C `traceparent` of the caller's span (ipc.traceparent): the turn's
    # trace continues it.  "" = a trace of its own (when tracing is on).
    traceparent: str = ""


class Attach(Msg, tag="attach"):
    id: int
    session: str
    # Replay retained events with seq >= from_seq first; None = live only.
    from_seq: int | None = None


class Detach(Msg, tag="detach"):
    id: int
    session: str


class Interrupt(Msg, tag="interrupt"):
    id: int
    session: str


class Stop(Msg, tag="stop"):
    id: int
    session: str


class Restart(Msg, tag="restart"):
    id: int
    session: str


class Remove(Msg, tag="rm"):
    id: int
    session: str


class Status(Msg, tag="status"):
    id: int
    session: str


class List(Msg, tag="ls"):
    """The sessions the client may see, selected by the daemon: each list
    non-empty keeps only the sessions matching one of its values (all the
    lists must match).  `limit` > 0 asks for one page: at most that many
    sessions, ordered by id, those after `after` (an id; "" = from the
    first); `SessionList.next` then says where the next page starts.  With
    neither, every matching session, in the daemon's order."""

    id: int
    states: list[str] = []
    owners: list[int] = []
    handlers: list[str] = []
    limit: int = 0
    after: str = ""


class Stats(Msg, tag="stats"):
    id: int


class Ping(Msg, tag="ping"):
    """Without a session: the daemon answers.  With one: the round trip goes
    through that session's worker (which must be live)."""

    id: int
    session: str | None = None


class Answer(Msg, tag="answer"):
    """Approve or deny a pending `PermissionRequest`."""

    id: int
    session: str
    request_id: str
    allow: bool


class Repair(Msg, tag="repair"):
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


class Welcome(Msg, tag="welcome"):
    protocol: int
    server_version: str
    pid: int


class Error(Msg, tag="error"):
    code: ErrorCode
    message: str
    id: int = 0  # 0 when the error answers no request (a bad frame)


class Ok(Msg, tag="ok"):
    id: int


class ExitInfo(Msg, tag="exit"):
    # exited, boot_failed, crashed, killed_memory, killed_turn_timeout,
    # killed_heartbeat, killed_processes, killed_disk (the session is then
    # stopped, not restarted), stopped
    reason: str
    code: int | None = None
    signal: int | None = None
    at: float = 0.0  # unix time
    detail: str = ""


class Waiting(Msg, tag="waiting"):
    """A permission request of the session's running turn that waits on a
    person (`Answer` settles it): what `SessionInfo.waiting` lists."""

    request_id: str
    tool: str
    since: float = 0.0  # unix time it was asked
    turn: int = 0
    seq: int = 0  # its PermissionRequest event's (an Attach from here replays it)


class SessionInfo(Msg, tag="session"):
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
    # Blocks its workspace held at the sweep's last walk of it (max_disk_mb;
    # a workspace image's statfs); None when not measured (no quota, or no
    # walk since its worker started).
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
    # Its workspace's files and directories at the same walk (max_disk_inodes).
    disk_inodes: int | None = None
    # Its running turn waits on a person: the permission requests not yet
    # answered, oldest first.  (Its state stays "running".)
    waiting: list[Waiting] = []


class Created(Msg, tag="created"):
    id: int
    session: SessionInfo


class Accepted(Msg, tag="accepted"):
    id: int
    session: str
    turn: int
    seq: int  # the events of this turn have seq > this


class Attached(Msg, tag="attached"):
    id: int
    session: str
    next_seq: int


class StatusReply(Msg, tag="status"):
    id: int
    session: SessionInfo


class Loading(Msg, tag="loading"):
    """A daemon just started loads the sessions on disk while it serves:
    how far it got (0 and 0 to an asker who is not an admin: how many
    sessions others hold is theirs to know).  A request naming a session
    loads it at once; what lists every session lists those loaded so far."""

    loaded: int = 0
    total: int = 0


class SessionList(Msg, tag="sessions"):
    id: int
    sessions: list[SessionInfo]
    # A page (List.limit) with more after it: the `after` of the next
    # request.  "" = nothing more.
    next: str = ""
    # Set while the daemon still loads the sessions on disk: the list holds
    # those loaded so far, and may lack some of the asker's.  None: complete.
    loading: Loading | None = None


class StatsReply(Msg, tag="stats"):
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
    # The lazy MCP servers' tool lists the daemon keeps for sessions, by
    # server: {"state": "pending"|"listed"|"unavailable", "tools", "version"}
    # and, for an admin, "error" (why it could not be listed).
    mcp: dict[str, Any] = {}
    # Set while the daemon still loads the sessions on disk (`sessions` and
    # `by_state` count those loaded so far).  None: every one is loaded.
    loading: Loading | None = None


class Pong(Msg, tag="pong"):
    id: int
    session: str | None = None
    pid: int = 0  # the daemon's, or the worker's for a session ping


class Repaired(Msg, tag="repaired"):
    id: int
    session: SessionInfo
    kept_records: int = 0
    dropped_records: int = 0  # intact records dropped (truncate)
    dropped_bytes: int = 0  # damaged bytes dropped


# Events: every one has session and seq.


class TextDelta(Msg, tag="text"):
    session: str
    seq: int
    turn: int
    text: str


class ReasoningDelta(Msg, tag="reasoning"):
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


class TurnDone(Msg, tag="turn_done"):
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


class TurnFailed(Msg, tag="turn_failed"):
    session: str
    seq: int
    turn: int
    reason: str


class StateChanged(Msg, tag="state"):
    session: str
    seq: int
    old: str
    new: str
    reason: str = ""


class LimitExceeded(Msg, tag="limit"):
    session: str
    seq: int
    kind: str  # memory, memory_high, turn_timeout, heartbeat, turns, restarts, budget...
    value: float
    limit: float
    # kind "budget": which ceiling (its config key) and the unit of value and
    # limit; kind "memory": the ceiling met when not the session's own cap
    # (daemon.max_memory_mb_per_uid, or the daemon's memory ceiling).
    ceiling: str = ""
    unit: str = ""


class Notice(Msg, tag="notice"):
    session: str
    seq: int
    turn: int
    kind: str
    data: dict[str, Any] = {}


class PermissionRequest(Msg, tag="permission_request"):
    session: str
    seq: int
    turn: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = {}


class Gap(Msg, tag="gap"):
    """Attach asked for events no longer retained; `seq` is the first one
    that will follow."""

    session: str
    seq: int
    from_seq: int


class Lagged(Msg, tag="lagged"):
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
