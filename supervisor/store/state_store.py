"""The state store seam: what the session manager needs from durable storage.

    StateStore                 one per daemon: the set of sessions
    ├── create(meta)           -> SessionLog   (a new session, fenced)
    ├── load(id)               -> (SessionLog, LoadedSession)   (fenced)
    ├── ids() / remove(id) / repair(id, mode)
    ├── spend                  -> SpendBook   (the spend ledger: supervisor.store.spend)
    SessionLog                 one per session, held by its one writer
    ├── append(record, durable) / sync() / sync_soon() / make_durable(_soon)()
    ├── write_snapshot(snap) / write_snapshot_soon(snap)
    ├── read_for_boot() / read_for_boot_soon() / read_history() / read_history_soon()
    ├── read_steps_soon(turn)  (a running turn's steps, read back to resume it)
    └── close() / remove() / remove_soon()

Each `*_soon` is its plain twin without blocking the daemon's loop, for
the loop's hot paths (a create, a revival, the snapshot after a turn, an
`rm`): it returns a future of the same outcome.  A store whose work is
quick and local does it inline and returns a settled future (`settled`);
one across a network (PostgreSQL) queues it behind the session's earlier
writes, so that it neither waits on the loop nor overtakes them.

The promises every implementation keeps (tests/test_store_contract.py runs
the same suite over each; a PostgreSQL store must pass it unchanged):

* `append(durable=True)` returns only once the record survives a crash;
  `append(durable=False)` followed by `sync()` likewise, or by `sync_soon()`
  once its future has completed (a group commit off the loop).  A record appended
  but not synced may be lost by a crash, never half-kept.
* A torn tail (the last record incomplete or failing its checksum, nothing
  valid after it) is dropped on load with a warning.  Damage followed by
  intact records is never dropped silently: load raises `StoreDamaged` and
  keeps everything as it is, until `repair(id, mode)`.
* Fencing: every `create`/`load` of a session takes a new, persisted
  *generation*.  A `SessionLog` holding an older one (a writer that was cut
  off, a second daemon) is refused with `Fenced` on its next append, sync or
  snapshot, so two writers can never interleave records.
* A session's writes land in the order they were made, whichever of
  them were `*_soon`: a snapshot never overtakes the appends before it,
  a removal never races a commit.
* A failure to write raises `StoreError` and leaves nothing half-written;
  `StoreFull` (a subclass) when the medium is out of space, so that clients
  can be told `no_space` rather than `internal`.

Errors:

    StoreError              a write that did not become durable; nothing acknowledged
    ├── StoreFull           ... because the disk (or quota, or file size limit) is full
    ├── IdTaken             a create whose id was taken meanwhile (also a FileExistsError)
    ├── Fenced              a newer writer opened the session; this handle may not write
    └── StoreDamaged        the stored session is corrupt beyond a torn tail
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import msgspec

# The errors a store raises are in supervisor/errors.py (the daemon's tree);
# re-exported here, with the protocols that raise them, for the core and the
# cluster code that import them from this seam.
from supervisor.errors import Fenced, HeldElsewhere, IdTaken, StoreDamaged, StoreError, StoreFull
from supervisor.logtag import tagged
from supervisor.store.spend import SpendBook

_T = TypeVar("_T")

__all__ = [
    "Abort",
    "Answered",
    "Asked",
    "Commit",
    "DamagedLog",
    "Fenced",
    "HeldElsewhere",
    "IdTaken",
    "InputRecord",
    "LIFE_EVENTS_KEPT",
    "LifeEvent",
    "LoadedSession",
    "Mark",
    "Meta",
    "Record",
    "RepairMode",
    "RepairResult",
    "Resume",
    "SessionLog",
    "Snapshot",
    "StateStore",
    "STEP_OVERHEAD_BYTES",
    "Step",
    "StepRecord",
    "StepStart",
    "boot_state",
    "check_stored_id",
    "logged",
    "settled",
    "turn_steps",
    "StoreDamaged",
    "StoreError",
    "StoreFull",
]


# ---------------------------------------------------------------- records


class _Rec(msgspec.Struct, tag_field="r", omit_defaults=True, kw_only=True, gc=False):
    """Records are data, never part of a cycle: untracked by the cyclic
    collector (`gc=False`, inherited), so reading back a long log (an
    export, a history, an import's replay) does not set off full
    collections that hold the GIL for tens of ms (ipc.messages does the same)."""


class Meta(_Rec, tag="meta"):
    id: str
    handler: str
    overrides: dict[str, Any] = {}
    created_at: float = 0.0
    owner_uid: int = 0
    parent: str | None = None
    depth: int = 0
    # Name of the session's directory under the workspace root ("ID@TOKEN");
    # empty for sessions made before workspaces were named so (they use ID).
    workspace: str = ""
    # The uid its worker and tools run as, when the daemon gives each
    # session its own; kept so that its files stay its own across restarts.
    run_uid: int | None = None


class InputRecord(_Rec, tag="input"):
    turn: int
    text: str
    seq: int
    at: float = 0.0


class Commit(_Rec, tag="commit"):
    turn: int
    reply: str
    record: bytes = b""
    interrupted: bool = False
    seq: int = 0
    # Tokens this turn spent (see SessionInfo.usage), and its LLM calls
    # (`llm_calls`, for [agent.budget]); summed at load.
    usage: dict[str, int] = {}
    # As its TurnDone said: a client that missed it reads them back (history).
    stop_reason: str = ""
    stop_detail: str = ""


class Abort(_Rec, tag="abort"):
    """A turn that failed or whose worker died; its input stays in the log."""

    turn: int
    reason: str
    record: bytes = b""
    seq: int = 0
    # What its calls spent before it ended (as Commit.usage): billed all the same.
    usage: dict[str, int] = {}


# What a step's record costs besides its result: counted against
# max_turn_steps_mb with its key, so that a flood of empty steps (or of
# starts) is bounded too.
STEP_OVERHEAD_BYTES = 64


class Step(_Rec, tag="step"):
    """A durable step of a running turn (`ctx.step`): what a resumed turn
    is given back.  `n` is the step's number, the order in which the turn
    started it; records come in the order steps ended.  Superseded by the
    turn's Commit or Abort: never read for a turn that has one."""

    turn: int
    n: int
    key: str
    kind: str = ""
    result: bytes = b""
    # It ended without a result (its function raised): a resumed turn runs
    # it again.  (Read as a result by a daemon older than this field.)
    failed: bool = False

    @property
    def size(self) -> int:
        """What it counts against `max_turn_steps_mb`."""
        return len(self.result) + len(self.key.encode()) + STEP_OVERHEAD_BYTES


class StepStart(_Rec, tag="step_start"):
    """Step `n` of a running turn began: after a crash, a step that began
    and has no `Step` was in flight.  (A daemon older than this record
    reads a log holding it as damaged.)"""

    turn: int
    n: int
    key: str
    kind: str = ""

    @property
    def size(self) -> int:
        return len(self.key.encode()) + STEP_OVERHEAD_BYTES


class Resume(_Rec, tag="resume"):
    """The turn was resumed on a new worker (for `history`)."""

    turn: int
    step: int
    reason: str
    cause: str = ""
    at: float = 0.0
    running: str = ""  # the key of the step in flight when its worker died ("" unknown)


class Asked(_Rec, tag="asked"):
    """A permission request of a running turn (for `history`: the request
    where it came, with its answer).  (A daemon older than this record, as
    for `Resume`, reads a log holding it as damaged.)"""

    turn: int
    request_id: str
    tool: str
    arguments: dict[str, Any] = {}
    at: float = 0.0  # unix time


class Answered(_Rec, tag="answered"):
    """Its answer: allowed or not, when, and by whom (the connection's uid
    and the name its client gave in `Hello`)."""

    turn: int
    request_id: str
    allowed: bool
    at: float = 0.0
    uid: int | None = None
    client: str = ""


class Mark(_Rec, tag="mark"):
    """State worth keeping across a daemon restart, and seq reservations."""

    # "stopped", "failed", "removing" (an rm began: finished at the next
    # start if the daemon died first) or "" (live/hibernated)
    state: str = ""
    reason: str = ""
    seq: int = 0  # seq numbers up to this one may have been used
    restarts: int = 0
    last_exit: dict[str, Any] | None = None


class LifeEvent(_Rec, tag="life"):
    """A lifecycle event worth keeping across daemon restarts (`sessionctl
    logs`): a state change other than a turn's own running and back, a
    limit hit, a failed turn.  `event` is the control protocol's event as
    msgpack (ipc.messages: `state`, `limit`, `turn_failed`), kept as bytes
    so that the log does not depend on those classes.  (A daemon older
    than this record reads a log holding it as damaged.)"""

    at: float  # unix time
    seq: int
    event: bytes


# The last LifeEvents a loaded session (and a snapshot) keeps.
LIFE_EVENTS_KEPT = 500

Record = Meta | InputRecord | Commit | Abort | Mark | LifeEvent | Step | StepStart | Resume | Asked | Answered
StepRecord = Step | StepStart


class Snapshot(msgspec.Struct, kw_only=True):
    gen: int  # the log generation that continues this snapshot
    meta: Meta
    turns: int
    seq: int
    handler_state: bytes = b""
    mark: Mark = msgspec.field(default_factory=Mark)
    # Token totals of the turns it replaces (their Commits are gone).
    usage: dict[str, int] = msgspec.field(default_factory=dict)
    # The last LIFE_EVENTS_KEPT lifecycle events, so compaction keeps them.
    lifecycle: list[LifeEvent] = msgspec.field(default_factory=list)


@dataclass(slots=True)
class LoadedSession:
    meta: Meta
    turns: int = 0
    seq: int = 0
    mark: Mark = field(default_factory=Mark)
    # The last input had no commit/abort: its worker (or the daemon) died.
    open_input: InputRecord | None = None
    usage: dict[str, int] = field(default_factory=dict)
    lifecycle: list[LifeEvent] = field(default_factory=list)  # oldest first, at most LIFE_EVENTS_KEPT
    # The step records (`Step`, `StepStart`) of `open_input`'s turn: how
    # many, and what they count against max_turn_steps_mb.  Not their
    # results: a resumed turn reads them back (`SessionLog.read_steps_soon`).
    open_step_records: int = 0
    open_step_bytes: int = 0

    @classmethod
    def replay(cls, session_id: str, snap: Snapshot | None, records: Iterable[Record]) -> LoadedSession:
        """The session a snapshot (if any) and the intact records after it
        make; StoreDamaged when nothing says what the session is."""
        loaded = (cls(meta=snap.meta, turns=snap.turns, seq=snap.seq, mark=snap.mark, usage=dict(snap.usage),
                      lifecycle=list(snap.lifecycle))
                  if snap is not None else None)
        for rec in records:
            if loaded is None and isinstance(rec, Meta):
                loaded = cls(meta=rec)
            elif loaded is not None:
                loaded.apply(rec)
        if loaded is None:
            raise StoreDamaged(session_id, "no metadata record", repairable=False)
        del loaded.lifecycle[:-LIFE_EVENTS_KEPT]
        check_stored_id(session_id, loaded.meta)
        return loaded

    def apply(self, rec: Record) -> None:
        """Fold one record in (the same for every store)."""
        match rec:
            case Meta():
                pass
            case InputRecord():
                self.turns = rec.turn
                self.seq = max(self.seq, rec.seq)
                self.open_input = rec
                self.open_step_records = self.open_step_bytes = 0
            case Step() | StepStart():
                if self.open_input is not None and self.open_input.turn == rec.turn:
                    self.open_step_records += 1
                    self.open_step_bytes += rec.size
            case Resume() | Asked() | Answered():
                pass
            case Commit() | Abort():
                self.seq = max(self.seq, rec.seq)
                add_usage(self.usage, rec.usage)
                if self.open_input is not None and self.open_input.turn == rec.turn:
                    self.open_input = None
                    self.open_step_records = self.open_step_bytes = 0
            case Mark():
                self.seq = max(self.seq, rec.seq)
                self.mark = rec
            case LifeEvent():
                self.seq = max(self.seq, rec.seq)
                self.lifecycle.append(rec)


def check_stored_id(session_id: str, meta: Meta) -> None:
    """A session is filed under the id its metadata names: one that names
    another (a row or a directory edited by hand) is not believed."""
    if meta.id != session_id:
        raise StoreDamaged(session_id, f"its metadata names another session ({meta.id!r})", repairable=False)


def add_usage(total: dict[str, int], more: Mapping[str, int]) -> None:
    for key, value in more.items():
        total[key] = total.get(key, 0) + value


def turn_steps(records: Iterable[Record], turn: int) -> list[StepRecord]:
    """The step records of the open turn `turn` among `records` (a log read
    back), in the order they were appended; none once it has ended."""
    steps: list[StepRecord] = []
    for rec in records:
        match rec:
            case Step() | StepStart() if rec.turn == turn:
                steps.append(rec)
            case InputRecord() | Commit() | Abort() if rec.turn == turn:
                steps = []
    return steps


def boot_state(snapshot: Snapshot | None, records: list[Record]) -> tuple[bytes, list[bytes], int]:
    """What a new worker needs, from a snapshot and the records after it:
    the handler state, the turn records (non-empty, in order), committed turns."""
    state, turns = (snapshot.handler_state, snapshot.turns) if snapshot is not None else (b"", 0)
    tail: list[bytes] = []
    for rec in records:
        if isinstance(rec, (Commit, Abort)):
            turns = max(turns, rec.turn)
            if rec.record:
                tail.append(rec.record)
    return state, tail, turns


class RepairMode(enum.StrEnum):
    SKIP_BAD = "skip_bad"  # keep every intact record, drop only the damaged bytes
    TRUNCATE = "truncate"  # keep what precedes the first damaged record


@dataclass(slots=True, frozen=True)
class RepairResult:
    kept_records: int
    dropped_records: int  # intact records dropped (truncate only)
    dropped_bytes: int  # damaged bytes dropped


# ---------------------------------------------------------------- the seam


class SessionLog(Protocol):
    """One session's durable state, as held by its single writer."""

    @property
    def generation(self) -> int:
        """The fencing generation this handle writes under."""
        ...

    def append(self, record: Record, durable: bool) -> None: ...

    def sync(self) -> None:
        """Make every append so far durable; on failure the unsynced tail
        is discarded (never kept without anyone being told it was saved)."""
        ...

    def sync_soon(self) -> asyncio.Future[None]:
        """`sync()` without blocking the daemon's loop: the future completes
        once every append so far is durable, or fails with `StoreError`
        (every append not yet durable discarded, as by a failed `sync`).
        Stores group these: one flush for whatever every session has pending."""
        ...

    def make_durable(self) -> None:
        """After `StateStore.create(durable=False)`: the session exists for sure."""
        ...

    def make_durable_soon(self) -> asyncio.Future[None]:
        """`make_durable` without blocking the daemon's loop (in the daemon's
        loop only); fails with `StoreError`."""
        ...

    def write_snapshot(self, snap: Snapshot) -> None:
        """Replace what precedes with `snap` (its `gen` is set by the store)."""
        ...

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        """`write_snapshot` without blocking the loop: after every append
        so far, before every later one.  The future fails with `StoreError`
        if it was not written (the log still holds every turn)."""
        ...

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]: ...

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        """`read_for_boot` without blocking the loop (a revival's read)."""
        ...

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        """The snapshot and the records after it, as stored (read-only)."""
        ...

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        """`read_history` without blocking the loop (history, export): a
        store across a network reads it on a connection of its own."""
        ...

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        """The step records of the open turn `turn`, as appended so far
        (`turn_steps`), read without blocking the loop: the daemon keeps
        no step's result in memory, and reads them back to resume a turn."""
        ...

    def at_rest(self, rest: bool) -> None:
        """The session has no worker (hibernated, stopped, failed), or has
        one again.  At rest a handle holds nothing open that the next write
        cannot take again (a file store closes its files once every append
        is durable), so that resting sessions cost the daemon no fd.  A
        handle `load` returns starts at rest.  A no-op where a handle holds
        nothing per session."""
        ...

    def close(self) -> None: ...

    def remove(self) -> None: ...

    def remove_soon(self) -> asyncio.Future[None]:
        """`remove` without blocking the loop: closes the handle now, and
        deletes the session after every write of it already made."""
        ...


class StateStore(Protocol):
    """Every session's durable state.  Runs in the daemon only."""

    def create(self, meta: Meta, durable: bool = True) -> SessionLog:
        """A new session with its metadata; `FileExistsError` if the id is taken.
        With durable=False a store may find the id taken only later: then
        `make_durable(_soon)` fails with `IdTaken` (a `StoreError` and a
        `FileExistsError`), and the handle writes nothing, ever."""
        ...

    def load(self, session_id: str) -> tuple[SessionLog, LoadedSession]:
        """Open a session for writing (a new generation) and read it back.
        Raises `StoreDamaged` (nothing changed) or `KeyError` (no such id)."""
        ...

    def ids(self) -> list[str]:
        """Every stored session, sorted."""
        ...

    def remove(self, session_id: str) -> None:
        """Delete a session that may not be loadable (a damaged one)."""
        ...

    def repair(self, session_id: str, mode: RepairMode) -> RepairResult:
        """Rewrite a damaged session atomically so that it loads again."""
        ...

    @property
    def spend(self) -> SpendBook:
        """What each session and uid spent on LLM calls (supervisor.store.spend):
        apart from the sessions, so that it outlives their removal."""
        ...

    def close(self) -> None:
        """The daemon is done with the store (every handle closed)."""
        ...


def settled(op: Callable[[], _T]) -> asyncio.Future[_T]:
    """`op` run now, as a future already done (or failed with its
    `StoreError`): a `*_soon` for a store whose work is done inline."""
    fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
    try:
        fut.set_result(op())
    except StoreError as exc:
        fut.set_exception(exc)
    return fut


def logged(fut: asyncio.Future[None], session_id: str, what: str) -> asyncio.Future[None]:
    """`fut`, whose failure is logged (as an error: `what` did not happen)
    whether or not anyone awaits it."""
    def done(f: asyncio.Future[None]) -> None:
        if not f.cancelled() and (exc := f.exception()) is not None:
            tagged(logging.getLogger("sessiond.store"), session_id).error("%s: %s", what, exc)

    fut.add_done_callback(done)
    return fut


class DamagedLog:
    """Stands in for the log of a session that could not be loaded, so the
    session can still be listed and removed: every write is refused."""

    def __init__(self, store: StateStore, session_id: str, reason: str) -> None:
        self._store = store
        self._id = session_id
        self._reason = reason

    @property
    def generation(self) -> int:
        return 0

    def _refuse(self) -> StoreError:
        return StoreError(
            f"session {self._id} is damaged ({self._reason}); nothing is written until "
            f"`sessionctl repair {self._id}` or `sessionctl rm {self._id}`"
        )

    def append(self, record: Record, durable: bool) -> None:
        raise self._refuse()

    def sync(self) -> None:
        raise self._refuse()

    def sync_soon(self) -> asyncio.Future[None]:
        raise self._refuse()

    def make_durable(self) -> None:
        raise self._refuse()

    def make_durable_soon(self) -> asyncio.Future[None]:
        raise self._refuse()

    def write_snapshot(self, snap: Snapshot) -> None:
        raise self._refuse()

    def write_snapshot_soon(self, snap: Snapshot) -> asyncio.Future[None]:
        raise self._refuse()

    def read_for_boot(self) -> tuple[bytes, list[bytes], int]:
        raise self._refuse()

    def read_for_boot_soon(self) -> asyncio.Future[tuple[bytes, list[bytes], int]]:
        raise self._refuse()

    def read_history(self) -> tuple[Snapshot | None, list[Record]]:
        raise self._refuse()

    def read_history_soon(self) -> asyncio.Future[tuple[Snapshot | None, list[Record]]]:
        raise self._refuse()

    def read_steps_soon(self, turn: int) -> asyncio.Future[list[StepRecord]]:
        raise self._refuse()

    def at_rest(self, rest: bool) -> None:
        pass  # a damaged session's handle holds nothing open

    def close(self) -> None:
        pass

    def remove(self) -> None:
        self._store.remove(self._id)

    def remove_soon(self) -> asyncio.Future[None]:
        # Rare (a damaged session's rm): the store's own, synchronous remove.
        return settled(self.remove)
