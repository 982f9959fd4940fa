"""The control link's operator requests: reading a session's past (history,
logs), moving it (export, import), watching the daemon (top) and running it
(drain, reload), with their replies.

Beside the sessions' own requests (ipc.messages), which every client
speaks; a client that needs none of these decodes the smaller union there.
A daemon that predates these answers `bad_request` (their tags do not
decode there).  `AnyRequest` and `AnyReply` are the unions the daemon and
sessionctl decode: the sessions' requests and these.
"""

from __future__ import annotations

from typing import Any

from ipc.messages import (
    Event,
    ExitInfo,
    LimitExceeded,
    Reply,
    Request,
    SessionInfo,
    StateChanged,
    TurnFailed,
)
from ipc.wirebase import Msg

__all__ = [
    "History", "HistoryTurn", "HistoryReply", "Logs", "LogEntry", "LogsReply", "Export",
    "ExportReply", "Import", "Top", "TopEntry", "TopReply", "Drain", "DrainMoved", "DrainLeft",
    "DrainReply", "DRAIN_MAX_TIMEOUT_SECS", "Reload", "ReloadReply", "AnyRequest", "AnyReply",
]

class History(Msg, tag="history"):
    """The conversation as stored.  Replied to with `HistoryReply`."""

    id: int
    session: str
    limit: int | None = None  # the last N turns; None = all the log holds


class HistoryTurn(Msg, tag="turn"):
    turn: int
    input: str
    at: float = 0.0  # unix time the input was accepted; 0 = not recorded
    # done, aborted, or open (the turn is running now)
    outcome: str = "open"
    reply: str = ""
    reason: str = ""  # why it was aborted
    interrupted: bool = False
    # A done turn's stop_reason and stop_detail, as its turn_done had them
    # ("" also for turns stored before they were kept).
    stop_reason: str = ""
    stop_detail: str = ""
    # {"id", "name", "arguments"} per call, {"id", "name", "output", "ok"?}
    # per result, in order (as the agent handler records them; other
    # handlers record none).  No "ok": a turn recorded before outcomes were
    # (unknown, not a success).
    tool_calls: list[dict[str, Any]] = []
    tool_results: list[dict[str, Any]] = []
    usage: dict[str, int] = {}
    # Each time its worker died and the turn went on on a new one:
    # {"at", "reason", "cause", "step"} (docs/agent.md, "Durable steps").
    resumed: list[dict[str, Any]] = []
    # An ended turn as its clients saw it live, for them to render alike
    # (supervisor/api/story.py): its text, tool calls and results (with
    # their outcome), permission requests with their answers, and the crash,
    # restart and resume markers where they happened.  seq: the stored one
    # where kept (lifecycle events), else 0.  Empty for the open turn.
    events: list[Event] = []


class HistoryReply(Msg, tag="history"):
    id: int
    session: str
    # Turns folded into the last snapshot: their inputs are no longer
    # stored one by one (the handler's state holds what it keeps of them).
    earlier_turns: int = 0
    # The agent handler's conversation as of that snapshot (OpenAI-format
    # messages), when the handler is the agent; else empty.
    earlier_messages: list[dict[str, Any]] = []
    turns: list[HistoryTurn] = []
    # Older turns of the log left out so that the reply fits in a frame.
    omitted_turns: int = 0


class Logs(Msg, tag="logs"):
    """The session's lifecycle events the daemon kept (state changes, limit
    hits, failed turns), with times.  Replied to with `LogsReply`."""

    id: int
    session: str
    limit: int | None = None


class LogEntry(Msg, tag="log"):
    at: float  # unix time
    event: StateChanged | LimitExceeded | TurnFailed


class LogsReply(Msg, tag="logs"):
    id: int
    session: str
    entries: list[LogEntry] = []
    last_exit: ExitInfo | None = None
    next_seq: int = 0  # attach from here to follow


class Export(Msg, tag="export"):
    """The session as a self-contained JSON document (`ExportReply.document`)
    for `Import` into another daemon."""

    id: int
    session: str


class ExportReply(Msg, tag="exported"):
    id: int
    session: str
    document: bytes  # JSON (supervisor.api.transfer.ExportDocument)


class Import(Msg, tag="import"):
    """Create a session from an exported document.  The document is
    validated as a hostile input; `session` renames it."""

    id: int
    document: bytes
    session: str | None = None


class Top(Msg, tag="top"):
    """Every visible session with its counters and CPU time, in one reply."""

    id: int


class TopEntry(Msg, tag="top_entry"):
    session: SessionInfo
    # CPU seconds (user + system) of the worker and its reaped children;
    # None without a live worker.
    cpu_secs: float | None = None


class TopReply(Msg, tag="top"):
    id: int
    at: float  # unix time of the sample
    uptime_secs: float
    rss_bytes: int  # the daemon's
    clients: int
    entries: list[TopEntry] = []


# The longest a drain may be given (a week).
DRAIN_MAX_TIMEOUT_SECS = 7 * 86400.0


class Drain(Msg, tag="drain"):
    """Cluster mode: keep new workers off a node and move its sessions to
    other nodes, each once it is idle (running turns finish first); with
    `undo`, take the node back into use.  Replied to with `DrainReply` once
    the node has no session left or `timeout_secs` ran out.  Admins only."""

    id: int
    node: str  # its IP address as `ls --json` shows it (`node`), or its Ray node id
    timeout_secs: float | None = None  # None: the daemon's default (supervisor.cluster.drain)
    undo: bool = False


class DrainMoved(Msg, tag="drain_moved"):
    session: str
    node: str  # where it runs now


class DrainLeft(Msg, tag="drain_left"):
    session: str
    state: str
    reason: str  # why it is still on the node


class DrainReply(Msg, tag="drain"):
    id: int
    node: str  # its IP address
    node_id: str  # its Ray node id
    draining: bool  # whether the node is kept free of new workers now
    moved: list[DrainMoved] = []
    left: list[DrainLeft] = []
    elapsed_secs: float = 0.0


class Reload(Msg, tag="reload"):
    """Re-read the daemon's config file, as SIGHUP does.  Admins only.
    Replied to with `ReloadReply` (a refused file is a reply, not an error)."""

    id: int


class ReloadReply(Msg, tag="reloaded"):
    id: int
    taken: bool  # False: the file was refused and the running config kept
    source: str = ""  # the file read (or "the embedded defaults")
    # What changed, one "dotted.key: old -> new" a line (taken only).
    changed: list[str] = []
    # Said about a change that does not apply at once (e.g. [store]).
    notes: list[str] = []
    error: str = ""  # why it was refused, naming the key and the file


# The unions as the daemon and sessionctl decode them: the protocol 1 ones
# and the requests/replies added since.
AnyRequest = Request | History | Logs | Export | Import | Top | Drain | Reload
AnyReply = Reply | HistoryReply | LogsReply | ExportReply | TopReply | DrainReply | ReloadReply
