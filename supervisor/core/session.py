"""A session as the daemon holds it, and who may change what of it.

Runs in the daemon.  `Session` is plain data; the parts of the daemon's core
each own some of its fields, and only they write them:

    SessionManager (manager.py,   the registry, meta, settings, children,
                    holding.py)   store, error, meta_lost, removing; _lock and
                                  _lock_users through `Session.locked`
    EventLog       (events.py)    state, seq, reserved_seq, ring, ring_bytes,
                                  subscribers, held, state_waiters, lifecycle
    TurnLedger     (ledger.py)    turns, current_turn, current_input,
                                  pending_input, turn_results,
                                  turn_started, last_turn_secs, last_active,
                                  usage (token totals of its turns:
                                  prompt_tokens, completion_tokens,
                                  reasoning_tokens, and llm_calls; restored
                                  from the log), committing, trace
    ResumableTurns (resumable.py) step_records, step_bytes, steps_flying,
                                  suspended
    Asks           (asks.py)      pending_asks
    WorkerOwner    (workers.py)   worker, last_exit, restarts, policy,
                                  restart_handle, pings
    Sweeper        (sweep.py)     memory
    TurnTimer      (turntimer.py) turn_timer, kill_timer
    Subagents      (subagents.py) spawned
    Damage         (damage.py)    store, error (on the manager's behalf)
    Budgets        (budgets.py)   turn_spend

The registry and a parent's `children` list are the manager's, kept by
`Intake` (intake.py: sessions in and out) on its behalf.  The registry
(registry.py: `Registry`) keeps its counts as it is written (owners, run
uids, the live sessions); whether a session is live follows from `state`
and `worker`, so EventLog and WorkerOwner tell it after writing them
(`Registry.relive`), and Holding after replacing `meta` (`meta_changed`).  A `WorkerProc`
is WorkerOwner's alone.  Others ask the owner through its
public operations (`EventLog.raise_seq`, `TurnLedger.take_input`,
`WorkerOwner.reconfigure`, `SessionManager.reclaimed`...); the one shared
write: WorkerOwner gives each new worker fresh `memory` figures, which the
Sweeper fills.  tests/test_architecture.py reads this table and holds it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.contract import ExitReason
from ipc.inputs import valid_session_id
from ipc.settings import SessionSettings
from supervisor.errors import SessiondError
from supervisor.core.limits import SessionMemory, resting_memory
from supervisor.core.tracer import TurnTrace
from supervisor.core.states import RestartPolicy, State
from supervisor.store.state_store import Meta, SessionLog

__all__ = ["PendingAsk", "PendingInput", "Session", "Subscriber", "Suspension", "WorkerProc", "damaged_hint",
           "valid_session_id"]


class Subscriber(Protocol):
    """A client attached to sessions (supervisor.api.server.ClientConn)."""

    uid: int
    # Tags of m.NEW_EVENT_TAGS this subscriber asked for in its Hello.
    event_tags: frozenset[str]

    def deliver(self, frame: bytes | bytearray) -> None: ...


@dataclass(slots=True)
class PendingInput:
    """The running turn's input, written but not yet fsync'd."""

    accepted: m.Accepted
    durable: asyncio.Future[m.Accepted]
    on_accepted: Callable[[m.Accepted], None] | None
    timer: asyncio.TimerHandle | None = None  # asks for its flush if the turn is slow
    flushing: bool = False


@dataclass(slots=True, eq=False)
class WorkerProc:
    pid: int
    conn: FramedProtocol[m.FromWorker]
    ready: asyncio.Future[None]
    exited: asyncio.Future[m.ExitInfo]
    started_at: float
    # Its heartbeat clock: the allowance runs from here.  Moved on past a
    # silence that was not the worker's own (the daemon's loop stalled, the
    # machine starving it of CPU, a delay on the way from its node).
    last_heartbeat: float
    beat_at: float  # when its last heartbeat (or Ready) came
    booted: bool = False
    boot_error: str = ""
    sandbox: dict[str, Any] = field(default_factory=dict)  # from its Ready
    # Why we asked it to go, so its exit is not mistaken for a crash.
    expected: str = ""
    # Set when we killed it for a reason of its own (a limit, a broken link,
    # a failed boot): how its exit is classified.
    kill_reason: ExitReason | None = None
    # What an expected exit is recorded as, when a limit stopped the
    # session (killed_disk) rather than a client.
    stop_reason: ExitReason | None = None
    kill_detail: str = ""
    # Whether its exit counts against the session's restart intensity: not
    # when it was killed because the store could not save what it sent (a
    # full disk, a database away: not its fault).
    charged: bool = True
    # Its Ready said the handler marks its work with ctx.step.
    uses_steps: bool = False


@dataclass(slots=True, frozen=True)
class Suspension:
    """A turn whose worker died, kept open to resume on the next worker
    (ResumableTurns.suspend, .resume; supervisor.core.steps)."""

    turn: int
    text: str
    reason: str  # the exit reason, or "daemon_stopped"
    cause: str  # what the handler is told (steps.cause_of)
    failure: str  # the TurnFailed reason if it is not resumed after all
    uncertain: bool = False  # (after a daemon restart: whether its steps in flight began is unknown)


@dataclass(slots=True, frozen=True)
class PendingAsk:
    """A permission request of the running turn that waits on a person
    (supervisor.core.asks)."""

    request: m.PermissionRequest  # as clients were sent it (its seq: where it is in the stream)
    since: float  # unix time


LIFECYCLE_KEEP = 500
# A turn's spend before it has any (one shared read-only empty).
NO_SPEND: Mapping[str, int] = MappingProxyType({})


@dataclass(slots=True, eq=False)
class Session:
    id: str
    meta: Meta
    store: SessionLog
    settings: SessionSettings
    state: State
    turns: int = 0
    seq: int = 0
    reserved_seq: int = 0
    restarts: int = 0
    last_exit: m.ExitInfo | None = None
    worker: WorkerProc | None = None
    current_turn: int | None = None
    current_input: str = ""
    # What a session at rest does not need is not allocated: the
    # containers below are None until first used, and let go of when empty
    # (a hibernated session costs the daemon what docs/internals.md says).
    subscribers: set[Subscriber] | None = None
    # Subscribers whose input is not acknowledged yet, with the events held
    # for them meanwhile: `Accepted` comes first (EventLog.hold).
    held: dict[Subscriber, list[bytes | bytearray]] | None = None
    # Retained events for `attach --from` (made at the first; dropped when it hibernates).
    ring: collections.deque[tuple[int, bytes | bytearray]] | None = None
    ring_bytes: int = 0
    policy: RestartPolicy | None = None
    # `locked`: the lock exists while a request holds it or waits for it.
    _lock: asyncio.Lock | None = None
    _lock_users: int = 0
    state_waiters: list[asyncio.Future[None]] | None = None
    # Session pings in flight: nonce -> callback(error or None).
    pings: dict[int, Callable[[SessiondError | None], None]] | None = None
    restart_handle: asyncio.TimerHandle | None = None
    last_active: float = field(default_factory=time.monotonic)
    children: tuple[str, ...] = ()  # (replaced whole: most sessions have none, and share the empty one)
    memory: SessionMemory = field(default_factory=resting_memory)  # (WorkerOwner: fresh for each worker)
    pending_input: PendingInput | None = None
    # The turn whose Commit is written and waiting for its flush (ledger).
    committing: int | None = None
    # The running turn's step records (ctx.step: starts and ends; their
    # results stay in the store), what they count against max_turn_steps_mb,
    # the steps its worker has begun and not ended (number -> key); the turn
    # held open while its worker restarts.
    step_records: int = 0
    step_bytes: int = 0
    steps_flying: dict[int, str] | None = None
    suspended: Suspension | None = None
    # Permission requests of the running turn awaiting a person's answer,
    # by request id, oldest first.
    pending_asks: dict[str, PendingAsk] | None = None
    # Resolved with (ok, reply or reason) when that turn ends; used to run
    # a sub-agent's task and hand its reply to the parent.
    turn_results: dict[int, asyncio.Future[tuple[bool, str]]] | None = None
    spawned: int = 0  # sub-agents started under this session (its whole tree, for a root)
    turn_started: float = 0.0
    last_turn_secs: float = float("inf")  # how long the last turn took
    turn_timer: asyncio.TimerHandle | None = None
    kill_timer: asyncio.TimerHandle | None = None
    # Why its stored state failed to load (state DAMAGED), or that another
    # daemon holds it (supervisor.core.fencing); None otherwise.
    error: str | None = None
    # DAMAGED with no readable metadata: meta is a stand-in.
    meta_lost: bool = False
    # An `rm` began: stored as its mark's state, so that a daemon killed
    # before the rm was done finishes it at its next start.
    removing: bool = False
    usage: dict[str, int] = field(default_factory=dict)
    # The running turn's spend so far, as its worker last reported it (m.Spent).
    turn_spend: Mapping[str, int] = field(default_factory=lambda: NO_SPEND)  # (replaced whole, never written into)
    # The running turn's trace, when tracing is on (supervisor.core.tracer).
    trace: TurnTrace | None = None
    # Lifecycle events with their unix time, for `sessionctl logs`: those
    # of earlier daemons as the log kept them (a turn's own running and
    # back are kept only since this daemon started), then this one's.  At
    # rest (and as loaded) packed into bytes (EventLog: unpacked at the next).
    lifecycle: collections.deque[tuple[float, m.StateChanged | m.LimitExceeded | m.TurnFailed]] | bytes = b""

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """Held while a request changes what runs (start, stop, hibernate...).
        The lock is made for its first user and goes with its last, holder
        or waiter: an idle session, of which a box holds thousands, keeps none."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        lock = self._lock
        self._lock_users += 1
        try:
            async with lock:
                yield
        finally:
            self._lock_users -= 1
            if not self._lock_users:
                self._lock = None

    @property
    def lock_held(self) -> bool:
        """Whether a request holds the lock now (asked without making one)."""
        return self._lock is not None and self._lock.locked()

    @property
    def persisted_state(self) -> str:
        if self.removing:
            return "removing"
        return self.state.value if self.state in (State.STOPPED, State.FAILED) else ""

    def is_(self, state: State) -> bool:
        """`session.state is state`, as a call: the state changes under
        awaits and callbacks, which type narrowing cannot see."""
        return self.state is state


def damaged_hint(session: Session) -> str:
    """What a client is told when it acts on a damaged session."""
    return (
        f"session {session.id} is damaged ({session.error}); `sessionctl repair {session.id} "
        f"--skip-bad` or `--truncate` recovers it, `sessionctl rm {session.id}` deletes it"
    )
