"""Sessions in the daemon: their state, their workers, their events.

Runs in the daemon's event loop, single-threaded.  The manager is the one
owner of session state; everything that changes a session goes through it:
requests from clients, messages from workers, exit reports from the zygote.
Transitions come from `supervisor.states` (pure); this module does the I/O
around them: spawning through the spawner, appending to the store, fanning
events out to attached clients.

Ordering rules that make the durability promises true:
* an input is appended (fsync) before `Accepted` is sent;
* a turn's output is appended (fsync) before `TurnDone` is sent;
* a worker that dies mid-turn gets an `Abort` record and a `TurnFailed`
  event naming the cause, and the turn is not replayed unless
  `retry_aborted_turn` is set.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
from ipc import messages as m
from ipc.connection import FramedProtocol
from ipc.errors import ProtocolError
from ipc.framing import FrameEncoder
from session_worker.main import EXIT_BOOT_FAILED
from session_worker.settings import SessionSettings
from supervisor.config import Config, valid_handler_name, workspace_root
from supervisor.errors import (
    BadRequest,
    Capacity,
    Conflict,
    Internal,
    LimitError,
    NoSpace,
    NotFound,
    PermissionDenied,
    SessiondError,
)
from supervisor.limits import MIB, ProcTable, SessionMemory, memory_verdict
from supervisor.overrides import OverrideError, resolve_overrides
from supervisor.states import LIVE, RestartPolicy, State, Trigger, transition
from supervisor.state_store import (
    Abort,
    Commit,
    DamagedLog,
    InputRecord,
    LoadedSession,
    Mark,
    Meta,
    RepairMode,
    RepairResult,
    SessionLog,
    Snapshot,
    StateStore,
    StoreDamaged,
    StoreError,
    StoreFull,
)
from supervisor.store import FileStateStore
from supervisor.zygote import ZygoteDied, ZygoteSpawner

__all__ = ["Session", "SessionManager", "Subscriber", "valid_session_id"]

log = logging.getLogger("sessiond.manager")

_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_worker_decoder = msgspec.msgpack.Decoder(m.FromWorker)
_settings_encoder = msgspec.msgpack.Encoder()
# Seq numbers are reserved in blocks, so a daemon killed mid-turn never
# hands out a seq a client has already seen.
_SEQ_BLOCK = 4096
_WORKER_FRAME_LIMIT = 1 << 30
# A turn that ends this soon after its input commits both with one fsync.
_GROUP_COMMIT_SECS = 0.002


def valid_session_id(session_id: str) -> bool:
    return _SESSION_ID.fullmatch(session_id) is not None


class Subscriber(Protocol):
    uid: int

    def deliver(self, frame: bytes | bytearray) -> None: ...


@dataclass(slots=True)
class _PendingInput:
    accepted: m.Accepted
    durable: asyncio.Future[m.Accepted]
    on_accepted: Callable[[m.Accepted], None] | None
    timer: asyncio.Handle
    streaming: bool = False


@dataclass(slots=True, eq=False)
class WorkerProc:
    pid: int
    conn: FramedProtocol[m.FromWorker]
    ready: asyncio.Future[None]
    exited: asyncio.Future[m.ExitInfo]
    started_at: float
    last_heartbeat: float
    booted: bool = False
    boot_error: str = ""
    # Why we asked it to go, so its exit is not mistaken for a crash.
    expected: str = ""
    # Set when a limit killed it: killed_memory, killed_turn_timeout, killed_heartbeat.
    kill_reason: str = ""
    kill_detail: str = ""


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
    subscribers: set[Subscriber] = field(default_factory=set)
    ring: collections.deque[tuple[int, bytes | bytearray]] = field(
        default_factory=collections.deque
    )
    ring_bytes: int = 0
    policy: RestartPolicy | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    state_waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # Session pings in flight: nonce -> callback(error or None).
    pings: dict[int, Callable[[SessiondError | None], None]] = field(default_factory=dict)
    restart_handle: asyncio.TimerHandle | None = None
    last_active: float = field(default_factory=time.monotonic)
    children: list[str] = field(default_factory=list)
    memory: SessionMemory = field(default_factory=SessionMemory)
    # The running turn's input, written but not yet fsync'd.
    pending_input: _PendingInput | None = None
    # Permission requests of the running turn awaiting a client's answer.
    pending_asks: set[str] = field(default_factory=set)
    # Resolved with (ok, reply or reason) when that turn ends; used to run
    # a sub-agent's task and hand its reply to the parent.
    turn_results: dict[int, asyncio.Future[tuple[bool, str]]] = field(default_factory=dict)
    spawned: int = 0  # sub-agents started under this session (its whole tree, for a root)
    turn_started: float = 0.0
    last_turn_secs: float = float("inf")  # how long the last turn took
    turn_timer: asyncio.TimerHandle | None = None
    kill_timer: asyncio.TimerHandle | None = None
    # Why its stored state failed to load (state DAMAGED); None otherwise.
    error: str | None = None
    # DAMAGED with no readable metadata: meta is a stand-in.
    meta_lost: bool = False

    @property
    def persisted_state(self) -> str:
        return self.state.value if self.state in (State.STOPPED, State.FAILED) else ""


class SessionManager:
    def __init__(
        self,
        config: Config,
        state_dir: Path,
        spawner: ZygoteSpawner,
        *,
        run_as: tuple[int, int] | None = None,
        session_uids: range | None = None,
        store: StateStore | None = None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.sessions_dir = state_dir / "sessions"
        self.store: StateStore = store if store is not None else FileStateStore(self.sessions_dir)
        self.workspaces_dir = state_dir / "workspaces"
        self.spawner = spawner
        self.sessions: dict[str, Session] = {}
        self._by_pid: dict[int, Session] = {}
        self._encoder = FrameEncoder()
        self._ping_nonce = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.proc_table = ProcTable()
        self._hibernating: set[str] = set()
        # Who workers run as: one user for all ([daemon] worker_user), or a
        # uid per session from this range (root, no worker_user), or as we do.
        self.run_as = run_as
        self.session_uids = session_uids if run_as is None else None
        self._retained_bytes = 0  # all sessions' rings together
        spawner.on_exit = self._on_exit
        spawner.on_zygote_lost = self._on_zygote_lost

    # ================================================================ load

    def load_all(self) -> None:
        """Restore every session on disk; live ones come back hibernated."""
        self.sessions_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.run_as is not None or self.session_uids is not None:
            # Workers running as another user must reach their workspace:
            # traverse (not list) the state dir; sessions/ stays private.
            self.workspaces_dir.mkdir(parents=True, exist_ok=True)
            for path in (self.state_dir, self.workspaces_dir):
                os.chmod(path, 0o711)
        for session_id in self.store.ids():
            try:
                store, loaded = self.store.load(session_id)
            except StoreDamaged as exc:
                self._add_damaged(session_id, exc.reason, exc.meta)
                continue
            except Exception as exc:
                self._add_damaged(session_id, f"cannot be loaded: {exc}", None)
                continue
            try:
                self._restore(store, loaded)
            except Exception as exc:
                store.close()
                self._add_damaged(session_id, f"cannot be restored: {exc}", loaded.meta)
        if self.sessions:
            log.info("restored %d session(s) from %s", len(self.sessions), self.sessions_dir)
        self._remove_orphaned_workspaces()

    def _restore(self, store: SessionLog, loaded: LoadedSession) -> None:
        meta = loaded.meta
        settings = self._settings_for(meta.id, meta.overrides)
        mark = loaded.mark
        state = {"stopped": State.STOPPED, "failed": State.FAILED}.get(mark.state, State.HIBERNATED)
        session = Session(
            id=meta.id, meta=meta, store=store, settings=settings, state=state,
            turns=loaded.turns, seq=loaded.seq, reserved_seq=loaded.seq,
            restarts=mark.restarts,
            last_exit=msgspec.convert(mark.last_exit, m.ExitInfo) if mark.last_exit else None,
        )
        session.ring = collections.deque(maxlen=self.config.daemon.event_retention)
        if loaded.open_input is not None:
            # The daemon died during this turn; what it streamed is gone.
            reason = "the daemon stopped during this turn"
            session.seq += 1
            store.append(Abort(turn=loaded.open_input.turn, reason=reason, seq=session.seq), durable=True)
        self.sessions[meta.id] = session
        if meta.parent and meta.parent in self.sessions:
            self.sessions[meta.parent].children.append(meta.id)

    def _add_damaged(self, session_id: str, reason: str, meta: Meta | None) -> None:
        """A session whose stored state does not load stays visible (ls,
        status: state "damaged" with the reason) and removable, and keeps
        its id taken, its files untouched, until repaired or removed.
        Without readable metadata only admins see it (owner uid 0)."""
        log.error("session %s is damaged and was not restored: %s", session_id, reason)
        session = Session(
            id=session_id, meta=meta or Meta(id=session_id, handler="?"),
            store=DamagedLog(self.store, session_id, reason),
            settings=self.config.session_settings(), state=State.DAMAGED,
            error=reason, meta_lost=meta is None,
        )
        session.ring = collections.deque(maxlen=self.config.daemon.event_retention)
        self.sessions[session_id] = session
        if session.meta.parent and session.meta.parent in self.sessions:
            self.sessions[session.meta.parent].children.append(session_id)

    # ================================================================ events

    def _emit(self, session: Session, event: m.Event) -> None:
        frame = self._encoder.encode(event)
        ring = session.ring
        if len(ring) == ring.maxlen:
            self._drop_oldest(session)
        ring.append((event.seq, frame))
        session.ring_bytes += len(frame)
        self._retained_bytes += len(frame)
        limit = self.config.daemon.event_retention_bytes
        if self._retained_bytes > self.config.daemon.event_retention_total_bytes:
            limit = min(limit, self._fair_share())
        while session.ring_bytes > limit and len(ring) > 1:
            self._drop_oldest(session)
        for sub in list(session.subscribers):
            sub.deliver(frame)

    def _drop_oldest(self, session: Session) -> None:
        size = len(session.ring.popleft()[1])
        session.ring_bytes -= size
        self._retained_bytes -= size

    def _fair_share(self) -> int:
        return self.config.daemon.event_retention_total_bytes // max(len(self.sessions), 1)

    def _trim_rings(self) -> None:
        """Over event_retention_total_bytes (sessions that emitted before
        others grew): every ring down to its share, newest event kept."""
        share = self._fair_share()
        for session in self.sessions.values():
            while session.ring_bytes > share and len(session.ring) > 1:
                self._drop_oldest(session)

    def _forget_ring(self, session: Session) -> None:
        self._retained_bytes -= session.ring_bytes
        session.ring.clear()
        session.ring_bytes = 0

    def _next_seq(self, session: Session) -> int:
        session.seq += 1
        if session.seq > session.reserved_seq:
            session.reserved_seq = session.seq + _SEQ_BLOCK
            self._write_mark(session, durable=False)
        return session.seq

    def _write_mark(self, session: Session, durable: bool) -> None:
        last = msgspec.to_builtins(session.last_exit) if session.last_exit else None
        mark = Mark(
            state=session.persisted_state, seq=session.reserved_seq,
            restarts=session.restarts, last_exit=last,
        )
        try:
            session.store.append(mark, durable=durable)
        except StoreError as exc:
            log.error("session %s: %s", session.id, exc)

    def _set_state(self, session: Session, trigger: Trigger, reason: str = "") -> None:
        old = session.state
        new = transition(old, trigger)
        session.state = new
        # A failed session needs an operator: say so where they look.
        level = logging.WARNING if new is State.FAILED else logging.DEBUG
        log.log(level, "session %s: %s -> %s (%s)", session.id, old, new, reason or trigger)
        self._emit(
            session,
            m.StateChanged(session=session.id, seq=self._next_seq(session), old=old, new=new, reason=reason),
        )
        waiters, session.state_waiters = session.state_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait_state(self, session: Session, states: Iterable[State], timeout: float) -> None:
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while session.state not in wanted:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Conflict(f"session {session.id} is still {session.state}; try again shortly")
            fut = asyncio.get_running_loop().create_future()
            session.state_waiters.append(fut)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(fut, remaining)

    def _settings_for(self, session_id: str, overrides: dict[str, Any]) -> SessionSettings:
        """A stored session's settings under the current config: overrides
        that no longer fit are pulled back inside the operator's bounds."""
        resolved = resolve_overrides(self.config.session_settings(), overrides, strict=False)
        for line in resolved.adjusted:
            log.warning("session %s: %s", session_id, line)
        return resolved.settings

    def _check_quota(self, uid: int) -> None:
        if self.is_admin(uid):
            return
        limit = self.config.daemon.max_sessions_per_uid
        held = sum(1 for s in self.sessions.values() if s.meta.owner_uid == uid)
        if held >= limit:
            raise Capacity(
                f"uid {uid} already has {held} sessions (max_sessions_per_uid = {limit}); "
                "remove some with `sessionctl rm`"
            )

    def _allocate_uid(self) -> int | None:
        """A uid of session_uid_range that no session holds and no user owns.
        Picked at random, so that a uid just freed is unlikely to be handed
        out again soon (what its last session left in /tmp stays its own)."""
        if self.session_uids is None:
            return None
        taken = {s.meta.run_uid for s in self.sessions.values()}
        span = self.session_uids
        for _ in range(64):
            uid = span[secrets.randbelow(len(span))]
            if uid not in taken and _no_such_user(uid):
                return uid
        free = [u for u in span if u not in taken and _no_such_user(u)]
        if not free:
            raise Capacity(f"every uid of [daemon] session_uid_range ({span.start}-{span.stop - 1}) is in use")
        return free[secrets.randbelow(len(free))]

    def _run_as(self, session: Session) -> tuple[int, int] | None:
        if self.run_as is not None:
            return self.run_as
        uid = session.meta.run_uid
        return (uid, uid) if uid is not None else None

    # ================================================================ lookups

    def is_admin(self, uid: int) -> bool:
        """Root and [daemon] admin_uids.  Not the daemon's own uid: under the
        unit that is also the uid a session's tools run as."""
        return uid == 0 or uid in self.config.daemon.admin_uids

    def get(self, session_id: str, uid: int | None = None) -> Session:
        """The session, if `uid` (None = the daemon itself) may touch it.
        Another user's session is answered exactly as a missing one, so
        that ids cannot be probed."""
        session = self.sessions.get(session_id)
        if session is None or (
            uid is not None and session.meta.owner_uid != uid and not self.is_admin(uid)
        ):
            raise NotFound(f"no session {session_id!r}")
        return session

    def visible(self, uid: int) -> list[Session]:
        if self.is_admin(uid):
            return list(self.sessions.values())
        return [s for s in self.sessions.values() if s.meta.owner_uid == uid]

    def info(self, session: Session, with_rss: bool = True) -> m.SessionInfo:
        worker = session.worker
        pid = worker.pid if worker is not None and not worker.exited.done() else None
        rss: int | None = None
        if pid is not None and with_rss:
            # The last sweep's figure (at most one poll interval old); a worker
            # not swept yet is measured now.
            rss = session.memory.rss_bytes or session.memory.measure(self.proc_table, pid)
        return m.SessionInfo(
            id=session.id, state=session.state.value, handler=session.meta.handler, pid=pid,
            rss_bytes=rss, restarts=session.restarts, turns=session.turns,
            created_at=session.meta.created_at, last_exit=session.last_exit, seq=session.seq,
            parent=session.meta.parent, children=list(session.children),
            owner_uid=session.meta.owner_uid, error=session.error,
        )

    def live_workers(self) -> int:
        return sum(1 for s in self.sessions.values() if s.worker is not None)

    # ================================================================ create

    async def create(
        self,
        owner_uid: int,
        session_id: str | None,
        handler: str | None,
        overrides: dict[str, Any],
        *,
        parent: Session | None = None,
    ) -> Session:
        if self._closing:
            raise Conflict("the daemon is shutting down")
        if session_id is None:
            session_id = secrets.token_hex(6)
        elif not valid_session_id(session_id):
            raise BadRequest(
                f"invalid session id {session_id!r}: 1-64 characters of A-Z a-z 0-9 . _ -, "
                "starting with a letter or digit"
            )
        if session_id in self.sessions:
            existing = self.sessions[session_id]
            if existing.state is State.DAMAGED:
                raise Conflict(f"session {session_id!r} already exists and is damaged "
                               f"({existing.error}); `sessionctl rm {session_id}` frees the id")
            raise Conflict(f"session {session_id!r} already exists")
        self._check_quota(owner_uid)
        if parent is not None:
            # The parent's own overrides, accepted when it was created, held
            # to today's ceilings.
            settings = self._settings_for(session_id, overrides)
        else:
            try:
                settings = resolve_overrides(self.config.session_settings(), overrides).settings
            except OverrideError as exc:
                raise BadRequest(str(exc)) from None
        if handler is None:
            handler = settings.agent.handler
        elif parent is None:
            _check_handler(handler, settings)
        if handler == "agent" and not settings.provider.configured:
            handler = "echo"
        # Order the worker first: the zygote forks (or hands over a spare)
        # while this process fsyncs the new session to disk.
        pending = self.spawner.request() if self._has_room() else None
        meta = Meta(
            id=session_id, handler=handler, overrides=overrides, created_at=time.time(),
            owner_uid=owner_uid, parent=parent.id if parent else None,
            depth=parent.meta.depth + 1 if parent else 0,
            # Never the same directory twice: a later session that reuses
            # this id, whoever creates it, starts with an empty workspace.
            workspace=f"{session_id}@{secrets.token_hex(8)}",
            run_uid=self._allocate_uid(),
        )
        try:
            # Durable below, while the worker boots: the create is answered
            # only once both are done.
            store = self.store.create(meta, durable=False)
        except FileExistsError:
            self._drop_pending(pending)
            raise Conflict(f"session {session_id!r} already exists") from None
        except StoreError as exc:
            self._drop_pending(pending)
            raise _store_failure("", exc) from None
        session = Session(
            id=session_id, meta=meta, store=store, settings=settings, state=State.STARTING,
            ring=collections.deque(maxlen=self.config.daemon.event_retention),
        )
        self.sessions[session_id] = session
        if parent is not None:
            parent.children.append(session_id)
        try:
            async with session.lock:
                await self._start_worker(session, pending, during_boot=store.make_durable)
        except StoreError as exc:
            self._discard(session)
            raise _store_failure(f"session {session_id!r} could not be saved: ", exc) from None
        except SessiondError as exc:
            # A create that cannot boot leaves nothing behind.
            self._discard(session)
            raise type(exc)(f"session {session_id!r} could not start: {exc.message}") from None
        except BaseException:
            self._discard(session)
            raise
        log.info("session %s created (handler %s, pid %s)", session_id, handler,
                 session.worker.pid if session.worker else "-")
        return session

    def _has_room(self) -> bool:
        return self._live_count() < self.config.agent.limits.max_concurrent_sessions

    def _drop_pending(self, pending: asyncio.Future[tuple[int, socket.socket]] | None) -> None:
        """A worker was ordered but will not be used: kill it when it comes."""
        if pending is None:
            return

        def discard(fut: asyncio.Future[tuple[int, socket.socket]]) -> None:
            if not fut.cancelled() and fut.exception() is None:
                pid, sock = fut.result()
                sock.close()
                self.spawner.signal(pid, signal.SIGKILL)

        pending.add_done_callback(discard)

    def _discard(self, session: Session) -> None:
        if session.worker is not None:
            log.warning("session %s: its create failed; killing worker %d", session.id, session.worker.pid)
            self.spawner.signal(session.worker.pid, signal.SIGKILL)
        self.sessions.pop(session.id, None)
        parent = self.sessions.get(session.meta.parent or "")
        if parent is not None and session.id in parent.children:
            parent.children.remove(session.id)
        session.store.remove()
        self._forget_ring(session)
        with contextlib.suppress(OSError):
            self._remove_workspace(session)

    # ================================================================ workers

    def _workspace_root(self) -> Path:
        return workspace_root(self.config, self.state_dir)

    def _workspace(self, session: Session) -> Path:
        return self._workspace_root() / (session.meta.workspace or session.id)

    def _prepare_workspace(self, session: Session) -> Path:
        """Create the session's workspace (0700, owned by whoever its worker
        runs as).  Only a directory the daemon itself named and created is
        chowned: never one that was already there, never through a link."""
        workspace = self._workspace(session)
        run_as = self._run_as(session)
        try:
            workspace.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(workspace, 0o700)
            except FileExistsError:
                st = os.lstat(workspace)
                if not stat.S_ISDIR(st.st_mode):
                    raise OSError(f"{workspace} exists and is not a directory") from None
                if run_as is not None and st.st_uid != run_as[0]:
                    raise OSError(
                        f"{workspace} belongs to uid {st.st_uid}, not to the session's uid {run_as[0]}"
                    ) from None
            else:
                if run_as is not None:
                    os.lchown(workspace, *run_as)
        except OSError as exc:
            log.warning("session %s: cannot prepare workspace %s: %s", session.id, workspace, exc)
        return workspace

    def _remove_workspace(self, session: Session) -> None:
        """Runs in a thread: a workspace can be large."""
        _rmtree(self._workspace(session))

    def _remove_orphaned_workspaces(self) -> None:
        """Workspaces ("ID@TOKEN") whose session is gone: the daemon died
        between removing a session and removing its workspace."""
        root = self._workspace_root()
        wanted = {s.meta.workspace for s in self.sessions.values()}
        # A damaged session whose metadata is unreadable keeps whatever may be its own.
        lost = tuple(f"{s.id}@" for s in self.sessions.values() if s.meta_lost)
        try:
            entries = list(os.scandir(root))
        except OSError:
            return
        for entry in entries:
            if (
                "@" in entry.name and entry.name not in wanted and not entry.name.startswith(lost)
                and entry.is_dir(follow_symlinks=False)
            ):
                log.info("removing the workspace of a deleted session: %s", entry.path)
                _rmtree(Path(entry.path))

    async def _start_worker(
        self,
        session: Session,
        pending: asyncio.Future[tuple[int, socket.socket]] | None = None,
        during_boot: Callable[[], None] | None = None,
    ) -> None:
        """Spawn (or take the worker already ordered), boot and wait for
        Ready; `during_boot` runs while the worker boots.  Caller holds
        session.lock and has put the session in STARTING."""
        assert session.state is State.STARTING, session.state
        loop = asyncio.get_running_loop()
        try:
            await self._make_room(session)
            snapshot, records, _ = session.store.read_for_boot()
        except BaseException as exc:
            self._drop_pending(pending)
            if isinstance(exc, OSError):
                raise Internal(f"cannot read its state: {exc}") from None
            raise
        try:
            pid, sock = await (pending if pending is not None else self.spawner.request())
        except ZygoteDied as exc:
            raise Internal(str(exc)) from None
        now = time.monotonic()
        worker: WorkerProc
        proto: FramedProtocol[m.FromWorker] = FramedProtocol(
            _worker_decoder,
            max_frame_bytes=_WORKER_FRAME_LIMIT,
            on_message=lambda msg: self._on_worker_message(session, worker, msg),
            on_bad_message=lambda exc: self._on_worker_bad_frame(session, worker, exc),
        )
        worker = WorkerProc(
            pid=pid, conn=proto, ready=loop.create_future(), exited=loop.create_future(),
            started_at=now, last_heartbeat=now,
        )
        session.worker = worker
        session.memory = SessionMemory()
        self._by_pid[pid] = session
        await loop.create_unix_connection(lambda: proto, sock=sock)
        workspace = self._prepare_workspace(session)
        run_as = self._run_as(session)
        proto.send(
            m.Boot(
                session=session.id, handler=session.meta.handler,
                settings=_settings_encoder.encode(session.settings),
                workspace=str(workspace), depth=session.meta.depth,
                turns=session.turns, snapshot=snapshot, records=records,
                run_as_uid=run_as[0] if run_as else None,
                run_as_gid=run_as[1] if run_as else None,
            )
        )
        if during_boot is not None:
            proto.flush()  # Boot goes out first, then our own work
            try:
                during_boot()
            except BaseException:
                worker.expected = "discarded"
                self.spawner.kill_tree(pid)
                raise
        try:
            await asyncio.wait_for(
                asyncio.shield(worker.ready), self.config.daemon.boot_timeout_secs
            )
        except asyncio.TimeoutError:
            worker.kill_reason = "boot_failed"
            worker.kill_detail = "no Ready within boot_timeout_secs"
            self.spawner.signal(pid, signal.SIGKILL)
            raise Internal(
                f"worker did not become ready within {self.config.daemon.boot_timeout_secs:g}s"
            ) from None
        except SessiondError:
            raise
        self._set_state(session, Trigger.READY)
        session.last_active = time.monotonic()

    def _on_worker_bad_frame(self, session: Session, worker: WorkerProc, exc: ProtocolError) -> None:
        # A worker that speaks garbage is broken: kill it; it restarts from the log.
        log.error("session %s: bad frame from worker %d: %s; killing it", session.id, worker.pid, exc)
        worker.kill_reason = worker.kill_reason or "crashed"
        worker.kill_detail = f"protocol error: {exc}"
        self.spawner.signal(worker.pid, signal.SIGKILL)

    def _on_worker_message(self, session: Session, worker: WorkerProc, msg: m.FromWorker) -> None:
        if session.worker is not worker:
            return  # a message from a worker we have already replaced
        match msg:
            case m.Heartbeat():
                worker.last_heartbeat = time.monotonic()
            case m.Delta(turn=turn, text=text):
                if session.pending_input is not None:
                    self._streaming(session)
                if turn == session.current_turn:
                    self._emit(
                        session,
                        m.TextDelta(session=session.id, seq=self._next_seq(session), turn=turn, text=text),
                    )
            case m.Done():
                self._on_done(session, worker, msg)
            case m.Failed():
                self._on_failed(session, msg)
            case m.Ready():
                worker.booted = True
                worker.last_heartbeat = time.monotonic()
                if not worker.ready.done():
                    worker.ready.set_result(None)
            case m.BootFailed(reason=reason):
                worker.boot_error = reason
                if not worker.ready.done():
                    worker.ready.set_exception(Internal(f"boot failed: {reason}"))
                    worker.ready.exception()  # mark retrieved
            case m.WorkerPong(nonce=nonce):
                answer = session.pings.pop(nonce, None)
                if answer is not None:
                    answer(None)
            case m.WorkerNotice(turn=turn, kind=kind, data=data):
                self._emit(
                    session,
                    m.Notice(session=session.id, seq=self._next_seq(session), turn=turn, kind=kind, data=data),
                )
            case m.WorkerLimit(kind=kind, value=value, limit=limit):
                self._emit(
                    session,
                    m.LimitExceeded(session=session.id, seq=self._next_seq(session), kind=kind,
                                    value=value, limit=limit),
                )
            case m.AskPermission(turn=turn, request_id=rid, tool=tool, arguments=arguments):
                session.pending_asks.add(rid)
                self._emit(
                    session,
                    m.PermissionRequest(session=session.id, seq=self._next_seq(session), turn=turn,
                                        request_id=rid, tool=tool, arguments=arguments),
                )
            case m.SpawnAgent():
                self._spawn_task(self._run_subagent(session, worker, msg))

    def _on_done(self, session: Session, worker: WorkerProc, msg: m.Done) -> None:
        if msg.turn != session.current_turn:
            log.warning("session %s: Done for turn %d, expected %s", session.id, msg.turn, session.current_turn)
            return
        seq = session.seq + 1
        try:
            session.store.append(
                Commit(turn=msg.turn, reply=msg.reply, record=msg.record,
                       interrupted=msg.interrupted, seq=seq),
                durable=True,
            )
        except StoreError as exc:
            # The worker is now ahead of the disk: make it restart from the disk.
            log.error("session %s: turn %d not persisted: %s", session.id, msg.turn, exc)
            self._end_turn(session, failed=f"the turn could not be saved: {exc}")
            worker.kill_reason = "crashed"
            worker.kill_detail = "its turn could not be saved"
            self.spawner.signal(worker.pid, signal.SIGKILL)
            return
        self._input_durable(session)  # the commit's fsync covered the input
        if msg.snapshot:
            try:
                session.store.write_snapshot(
                    Snapshot(
                        gen=0, meta=session.meta, turns=session.turns, seq=session.reserved_seq,
                        handler_state=msg.snapshot,
                        mark=Mark(state=session.persisted_state, seq=session.reserved_seq,
                                  restarts=session.restarts,
                                  last_exit=msgspec.to_builtins(session.last_exit) if session.last_exit else None),
                    )
                )
            except StoreError as exc:
                log.warning("session %s: %s (the log still holds every turn)", session.id, exc)
        self._turn_over(session, (True, msg.reply))
        session.current_input = ""
        self._next_seq(session)  # == seq
        self._emit(
            session,
            m.TurnDone(session=session.id, seq=seq, turn=msg.turn, reply=msg.reply, interrupted=msg.interrupted),
        )
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._set_state(session, Trigger.TURN_END)

    def _on_failed(self, session: Session, msg: m.Failed) -> None:
        if msg.turn != session.current_turn:
            return
        session.current_input = ""
        self._abort_turn(session, msg.reason, msg.record)
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._set_state(session, Trigger.TURN_END, reason="turn failed")

    def _abort_turn(self, session: Session, reason: str, record: bytes = b"") -> None:
        turn = session.current_turn
        if turn is None:
            return
        seq = session.seq + 1
        try:
            session.store.append(Abort(turn=turn, reason=reason, record=record, seq=seq), durable=True)
        except StoreError as exc:
            log.error("session %s: %s", session.id, exc)
            self._sync_input(session)
        self._input_durable(session)
        self._turn_over(session, (False, reason))
        self._next_seq(session)
        self._emit(session, m.TurnFailed(session=session.id, seq=seq, turn=turn, reason=reason))

    def _turn_over(self, session: Session, outcome: tuple[bool, str]) -> None:
        fut = session.turn_results.pop(session.current_turn or 0, None)
        if fut is not None and not fut.done():
            fut.set_result(outcome)
        session.current_turn = None
        session.last_turn_secs = time.monotonic() - session.turn_started
        session.pending_asks.clear()
        session.last_active = time.monotonic()
        for timer in (session.turn_timer, session.kill_timer):
            if timer is not None:
                timer.cancel()
        session.turn_timer = session.kill_timer = None

    def _end_turn(self, session: Session, failed: str) -> None:
        self._abort_turn(session, failed)
        if session.state in (State.RUNNING, State.INTERRUPTING):
            self._set_state(session, Trigger.TURN_END, reason="turn failed")

    # ---------------------------------------------------------------- exits

    def _on_zygote_lost(self) -> None:
        for pid in list(self._by_pid):
            self._on_exit(pid, None, signal.SIGKILL, detail="the zygote died")

    def _on_exit(self, pid: int, code: int | None, sig: int | None, detail: str = "") -> None:
        session = self._by_pid.pop(pid, None)
        if session is None:
            return
        worker = session.worker
        if worker is None or worker.pid != pid:
            self.spawner.kill_tree(pid)
            return
        if not worker.expected:
            # Tools left behind die with the worker: its group, and the ones
            # that left the group but were seen as its descendants.  (An
            # expected exit is tidied up by _terminate, after a grace.)
            self.spawner.kill_tree(pid, session.memory.escapees())
        self.proc_table.forget(pid)
        reason = _classify(worker, code, sig)
        info = m.ExitInfo(
            reason=reason, code=code, signal=sig, at=time.time(),
            detail=detail or worker.expected or worker.kill_detail or worker.boot_error,
        )
        worker.exited.set_result(info)
        if not worker.ready.done():
            worker.ready.set_exception(Internal(_describe_exit(info)))
            worker.ready.exception()
        pings, session.pings = session.pings, {}
        for answer in pings.values():
            answer(Conflict(f"session {session.id}: the worker exited before answering"))
        session.worker = None
        session.last_exit = info
        if worker.expected:
            log.info("session %s: worker %d exited (%s)", session.id, pid, worker.expected)
            session.current_input = ""
            self._abort_turn(session, f"the session was {worker.expected}")
            return
        log.warning("session %s: worker %d %s", session.id, pid, _describe_exit(info))
        self._abort_turn(session, _describe_exit(info))
        if session.state is State.STARTING and not worker.booted:
            return  # _start_worker's caller decides (create fails, revive retries)
        if session.state in LIVE:
            self._set_state(session, Trigger.EXIT, reason=reason)
            self._schedule_restart(session)

    def _schedule_restart(self, session: Session) -> None:
        if self._closing:
            return
        ws = session.settings.agent.worker
        if session.policy is None:
            session.policy = RestartPolicy(
                ws.max_restart_attempts, ws.restart_window_secs,
                ws.restart_backoff_initial_ms, ws.restart_backoff_max_ms,
            )
        decision = session.policy.on_failure(time.monotonic())
        if not decision.restart:
            log.error(
                "session %s: giving up restarting it after %d failures within %gs (last: %s); "
                "`sessionctl restart %s` tries again",
                session.id, decision.attempts_in_window, ws.restart_window_secs,
                _describe_exit(session.last_exit), session.id,
            )
            self._set_state(
                session, Trigger.GIVE_UP,
                reason=f"{decision.attempts_in_window} failures within {ws.restart_window_secs:g}s",
            )
            self._emit(
                session,
                m.LimitExceeded(session=session.id, seq=self._next_seq(session), kind="restarts",
                                value=decision.attempts_in_window, limit=ws.max_restart_attempts),
            )
            self._write_mark(session, durable=True)
            return
        self._set_state(session, Trigger.BACKOFF, reason=f"restart in {decision.delay_secs:.3f}s")
        loop = asyncio.get_running_loop()
        session.restart_handle = loop.call_later(
            decision.delay_secs, lambda: self._spawn_task(self._auto_restart(session))
        )

    async def _auto_restart(self, session: Session) -> None:
        session.restart_handle = None
        async with session.lock:
            if session.state is not State.RESTARTING or self._closing:
                return
            try:
                await self._make_room(session)
            except Capacity:
                self._set_state(session, Trigger.HIBERNATE,
                                reason="no room to restart (max_concurrent_sessions); the next input revives it")
                return
            session.restarts += 1
            self._write_mark(session, durable=False)
            self._set_state(session, Trigger.SPAWN, reason=f"restart #{session.restarts}")
            try:
                await self._start_worker(session)
            except SessiondError as exc:
                log.warning("session %s: restart failed: %s", session.id, exc)
                if _is(session, State.STARTING):
                    self._set_state(session, Trigger.EXIT, reason="boot_failed")
                    self._schedule_restart(session)
                return
            retry = (
                session.settings.agent.worker.retry_aborted_turn and session.current_input
            )
            if retry:
                text, session.current_input = session.current_input, ""
                self._begin_turn(session, text)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _terminate(self, session: Session, expected: str, grace: float) -> None:
        """Stop a worker and everything it started, trio-style: ask, wait,
        then kill.  Shutdown to the worker and SIGTERM to its process group
        (the worker takes SIGTERM as Shutdown; tools get their chance to
        exit cleanly); after `grace`, SIGKILL to whatever is left."""
        worker = session.worker
        if worker is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        worker.expected = expected
        # Learn its descendants now, while they are still its descendants:
        # those that left the process group are signalled by their pidfds.
        session.memory.measure(self.proc_table, worker.pid)
        escapees = session.memory.escapees()
        worker.conn.send(m.Shutdown())
        self.spawner.kill_tree(worker.pid, escapees, signal.SIGTERM)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(worker.exited), grace)
        while loop.time() < deadline and self.spawner.tree_alive(worker.pid, escapees):
            await asyncio.sleep(0.02)
        if self.spawner.tree_alive(worker.pid, escapees):
            log.warning("session %s: processes still running %.1fs after SIGTERM; killing them",
                        session.id, grace)
            # Children they started since are found from them, not by number.
            session.memory.measure(self.proc_table, worker.pid)
            escapees = session.memory.escapees()
        self.spawner.kill_tree(worker.pid, escapees)
        if not worker.exited.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(worker.exited), 10.0)

    # ================================================================ requests

    async def send(
        self,
        session: Session,
        text: str,
        subscriber: Subscriber | None,
        on_accepted: Callable[[m.Accepted], None] | None = None,
    ) -> m.Accepted:
        """Start a turn; returns once its input is durable.  `on_accepted`
        is called at that moment, before any later event of the turn."""
        if self._closing:
            raise Conflict("the daemon is shutting down; no new turns")
        async with session.lock:
            if session.state is State.HIBERNATED:
                # Room first, so that "no room" leaves it hibernated.
                await self._make_room(session)
                self._set_state(session, Trigger.SPAWN, reason="input")
                try:
                    await self._start_worker(session)
                except SessiondError:
                    if _is(session, State.STARTING):
                        self._set_state(session, Trigger.EXIT, reason="boot_failed")
                        self._schedule_restart(session)
                    raise
        if session.state in (State.STARTING, State.RESTARTING, State.CRASHED):
            await self._wait_state(
                session, (State.IDLE, State.FAILED, State.STOPPED, State.DELETED, State.RUNNING),
                self.config.daemon.boot_timeout_secs,
            )
        match session.state:
            case State.IDLE:
                pass
            case State.RUNNING | State.INTERRUPTING:
                raise Conflict(f"session {session.id} is busy with turn {session.current_turn}; "
                               "wait for it to end or interrupt it")
            case State.STOPPED | State.STOPPING:
                raise Conflict(f"session {session.id} is stopped; `sessionctl restart {session.id}` starts it")
            case State.DAMAGED:
                raise Conflict(_damaged_hint(session))
            case State.FAILED:
                raise Conflict(f"session {session.id} has failed ({_describe_exit(session.last_exit)}); "
                               f"`sessionctl restart {session.id}` starts it again")
            case _:
                raise Conflict(f"session {session.id} is {session.state}")
        if subscriber is not None:
            session.subscribers.add(subscriber)
        return await self._begin_turn(session, text, on_accepted)

    def _begin_turn(
        self, session: Session, text: str, on_accepted: Callable[[m.Accepted], None] | None = None
    ) -> asyncio.Future[m.Accepted]:
        turn = session.turns + 1
        worker = session.worker
        assert worker is not None
        try:
            session.store.append(
                InputRecord(turn=turn, text=text, seq=session.seq, at=time.time()), durable=False
            )
        except StoreError as exc:
            raise _store_failure("input not accepted: ", exc) from None
        # The worker starts on the input before it is durable.  A session
        # whose last turn was quick (echo, a calculator) will likely end this
        # one within _GROUP_COMMIT_SECS too, and the turn's commit then makes
        # the input durable with the same fsync; otherwise (an LLM call) the
        # input is fsync'd at once, so that Accepted, and the client's first
        # token behind it, are not held back.  Accepted always waits for the
        # fsync that covers the input.
        worker.conn.send(m.Input(turn=turn, text=text))
        worker.conn.flush()
        loop = asyncio.get_running_loop()
        accepted = m.Accepted(id=0, session=session.id, turn=turn, seq=session.seq)
        durable: asyncio.Future[m.Accepted] = loop.create_future()
        if session.last_turn_secs < _GROUP_COMMIT_SECS:
            sync: asyncio.Handle = loop.call_later(_GROUP_COMMIT_SECS, self._sync_input, session)
        else:
            sync = loop.call_soon(self._sync_input, session)
        session.pending_input = _PendingInput(accepted, durable, on_accepted, sync)
        session.turns = turn
        session.current_turn = turn
        session.current_input = text
        session.last_active = time.monotonic()
        session.turn_started = time.monotonic()
        session.turn_timer = asyncio.get_running_loop().call_later(
            session.settings.agent.turn_timeout_secs, self._on_turn_timeout, session, turn
        )
        self._set_state(session, Trigger.INPUT, reason=f"turn {turn}")
        return durable

    def _streaming(self, session: Session) -> None:
        """The turn is streaming: its client wants Accepted (and the text)
        now, not after the group-commit window.  Sync once this batch of
        worker messages is handled: a Done in the same batch still covers
        the input with its own fsync."""
        pending = session.pending_input
        if pending is not None and not pending.streaming:
            pending.streaming = True
            pending.timer.cancel()
            pending.timer = asyncio.get_running_loop().call_soon(self._sync_input, session)

    def _sync_input(self, session: Session) -> None:
        """The turn is still running: make its input durable on its own."""
        pending = session.pending_input
        if pending is None:
            return
        try:
            session.store.sync()
        except StoreError as exc:
            worker = session.worker
            if worker is not None:
                # It has an input the log does not: it must restart from the log.
                log.error("session %s: input not saved (%s); killing worker %d", session.id, exc, worker.pid)
                worker.kill_reason = "crashed"
                worker.kill_detail = "its input could not be saved"
                self.spawner.kill_tree(worker.pid, session.memory.escapees())
            self._input_durable(session, _store_failure("input not accepted: ", exc))
            return
        self._input_durable(session)

    def _input_durable(self, session: Session, error: SessiondError | None = None) -> None:
        """After the fsync that covers the pending input: acknowledge it
        (synchronously, so `Accepted` precedes the turn's last events)."""
        pending, session.pending_input = session.pending_input, None
        if pending is None:
            return
        pending.timer.cancel()
        if error is not None:
            pending.durable.set_exception(error)
            pending.durable.exception()  # retrieved by whoever awaits, if anyone
            return
        if pending.on_accepted is not None:
            pending.on_accepted(pending.accepted)
        pending.durable.set_result(pending.accepted)

    def attach(self, session: Session, subscriber: Subscriber, from_seq: int | None) -> int:
        """Subscribe; replay retained events from `from_seq`.  Returns next seq."""
        session.subscribers.add(subscriber)
        if from_seq is not None:
            oldest = session.ring[0][0] if session.ring else session.seq + 1
            if from_seq < oldest:
                subscriber.deliver(
                    self._encoder.encode(m.Gap(session=session.id, seq=oldest, from_seq=from_seq))
                )
            for seq, frame in session.ring:
                if seq >= from_seq:
                    subscriber.deliver(frame)
        return session.seq + 1

    def detach(self, subscriber: Subscriber, session: Session | None = None) -> None:
        targets = [session] if session is not None else list(self.sessions.values())
        for s in targets:
            s.subscribers.discard(subscriber)

    def interrupt(self, session: Session) -> None:
        if session.state is State.INTERRUPTING:
            return
        if session.state is not State.RUNNING or session.worker is None:
            raise Conflict(f"session {session.id} has no running turn")
        self._set_state(session, Trigger.INTERRUPT, reason="interrupted by a client")
        session.worker.conn.send(m.InterruptTurn(turn=session.current_turn or 0))

    async def stop(self, session: Session, reason: str = "stopped") -> None:
        if session.state is State.DAMAGED:
            raise Conflict(_damaged_hint(session))
        for child_id in list(session.children):
            child = self.sessions.get(child_id)
            if child is not None:
                await self.stop(child, f"parent {session.id} {reason}")
        async with session.lock:
            await self._stop_locked(session, reason)

    async def _stop_locked(self, session: Session, reason: str) -> None:
        if session.state in (State.STOPPED, State.DELETED, State.DAMAGED):
            return  # (a damaged child of a stopped parent: nothing runs)
        if session.restart_handle is not None:
            session.restart_handle.cancel()
            session.restart_handle = None
        self._set_state(session, Trigger.STOP, reason=reason)
        await self._terminate(session, "stopped", self.config.daemon.stop_grace_secs)
        self._set_state(session, Trigger.STOPPED, reason=reason)
        self._write_mark(session, durable=True)

    async def restart(self, session: Session) -> None:
        if session.state is State.DAMAGED:
            raise Conflict(_damaged_hint(session))
        async with session.lock:
            if session.state in LIVE:
                await self._stop_locked(session, "restart")
            if session.restart_handle is not None:
                session.restart_handle.cancel()
                session.restart_handle = None
            await self._make_room(session)
            self._set_state(session, Trigger.RESTART, reason="restart requested")
            if session.policy is not None:
                session.policy.reset()
            self._write_mark(session, durable=True)
            try:
                await self._start_worker(session)
            except SessiondError:
                if session.state is State.STARTING:
                    self._set_state(session, Trigger.GIVE_UP, reason="boot_failed")
                    self._write_mark(session, durable=True)
                raise

    async def remove(self, session: Session) -> None:
        for child_id in list(session.children):
            child = self.sessions.get(child_id)
            if child is not None:
                await self.remove(child)
        async with session.lock:
            if session.state is State.DELETED:
                return
            if session.state in LIVE:
                await self._stop_locked(session, "deleted")
            if session.restart_handle is not None:
                session.restart_handle.cancel()
            self._set_state(session, Trigger.DELETE, reason="deleted")
            self.sessions.pop(session.id, None)
            parent = self.sessions.get(session.meta.parent or "")
            if parent is not None and session.id in parent.children:
                parent.children.remove(session.id)
            session.store.remove()
            session.subscribers.clear()
            self._forget_ring(session)
            if session.meta_lost:
                # Which workspace is its own is unknown; the next start's
                # sweep of orphaned workspaces removes it.
                log.info("session %s deleted", session.id)
                return
            try:
                await asyncio.to_thread(self._remove_workspace, session)
            except OSError as exc:
                log.error("session %s: its workspace %s could not be removed: %s",
                          session.id, self._workspace(session), exc)
            log.info("session %s deleted", session.id)

    async def repair(self, session: Session, mode: str) -> tuple[Session, RepairResult]:
        """Rewrite a damaged session's stored state per `mode`, then restore
        it as at start-up (hibernated, or stopped/failed as it was)."""
        try:
            how = RepairMode(mode)
        except ValueError:
            raise BadRequest(f"unknown repair mode {mode!r}: use skip_bad or truncate") from None
        async with session.lock:
            if session.state is not State.DAMAGED:
                raise Conflict(f"session {session.id} is {session.state}, not damaged; nothing to repair")
            try:
                result = self.store.repair(session.id, how)
                store, loaded = self.store.load(session.id)
            except StoreDamaged as exc:
                session.error = exc.reason
                raise Conflict(f"session {session.id} cannot be repaired: {exc.reason}") from None
            except StoreError as exc:
                raise _store_failure(f"session {session.id} could not be repaired: ", exc) from None
            except OSError as exc:
                raise Internal(f"session {session.id} could not be repaired: {exc}") from None
            log.warning("session %s repaired (%s): %d record(s) kept, %d intact record(s) and "
                        "%d damaged byte(s) dropped", session.id, how.value, result.kept_records,
                        result.dropped_records, result.dropped_bytes)
            self._set_state(session, Trigger.REPAIR, reason=f"repaired ({how.value})")
            subscribers, children = session.subscribers, session.children
            del self.sessions[session.id]
            parent = self.sessions.get(session.meta.parent or "")
            if parent is not None and session.id in parent.children:
                parent.children.remove(session.id)
            self._forget_ring(session)
            try:
                self._restore(store, loaded)
            except BaseException:
                store.close()
                self._add_damaged(session.id, "cannot be restored after repair", loaded.meta)
                raise
            restored = self.sessions[session.id]
            restored.subscribers = subscribers
            restored.children = [c for c in children if c in self.sessions]
            return restored, result

    def ping(self, session: Session, answer: Callable[[SessiondError | None], None]) -> int:
        """Round trip through the worker; `answer` is called with None when
        it replies, or with the error if it dies first.  No timer: a worker
        that stops answering stops its heartbeats too, and the sweep kills
        it, which answers every ping in flight.  Returns the worker's pid."""
        worker = session.worker
        if worker is None or not worker.booted or worker.exited.done():
            raise Conflict(f"session {session.id} has no live worker ({session.state})")
        self._ping_nonce += 1
        session.pings[self._ping_nonce] = answer
        worker.conn.send(m.WorkerPing(nonce=self._ping_nonce))
        return worker.pid

    def answer(self, session: Session, request_id: str, allow: bool) -> None:
        worker = session.worker
        if worker is None or request_id not in session.pending_asks:
            raise NotFound(f"session {session.id} has no pending permission request {request_id!r}")
        session.pending_asks.discard(request_id)
        worker.conn.send(m.PermissionAnswer(request_id=request_id, allow=allow))

    # ================================================================ sub-agents

    def _root(self, session: Session) -> Session:
        while session.meta.parent and session.meta.parent in self.sessions:
            session = self.sessions[session.meta.parent]
        return session

    async def _run_subagent(self, parent: Session, worker: WorkerProc, msg: m.SpawnAgent) -> None:
        """A worker's spawn_agent: run `task` in a child session, answer with
        its reply.  The daemon, not the worker, forks and supervises the
        child, which gets the parent's limits (its overrides) or tighter."""
        try:
            reply = await self._subagent_reply(parent, msg)
            result = m.SpawnResult(request_id=msg.request_id, ok=True, reply=reply)
        except SessiondError as exc:
            result = m.SpawnResult(request_id=msg.request_id, ok=False, reason=exc.message)
        except Exception as exc:  # never let one spawn take the daemon down
            log.exception("session %s: sub-agent failed", parent.id)
            result = m.SpawnResult(request_id=msg.request_id, ok=False, reason=f"internal error: {exc}")
        if parent.worker is worker:
            worker.conn.send(result)

    def _child_id(self, parent: Session) -> str:
        """PARENT.XXXXXX, the parent's id cut from the right so that the
        child's id stays a valid one (starts like its parent's, <= 64)."""
        for _ in range(16):
            child_id = f"{parent.id[:57]}.{secrets.token_hex(3)}"
            if child_id not in self.sessions:
                return child_id
        raise Conflict(f"no free id for a sub-agent of {parent.id}")

    async def _subagent_reply(self, parent: Session, msg: m.SpawnAgent) -> str:
        limits = parent.settings.agent.subagents
        depth = parent.meta.depth + 1
        if depth > limits.max_depth:
            raise LimitError(f"sub-agent refused: max_depth {limits.max_depth} reached")
        root = self._root(parent)
        if root.spawned >= limits.max_total_spawns:
            raise LimitError(f"sub-agent refused: max_total_spawns {limits.max_total_spawns} reached")
        running = sum(
            1 for cid in parent.children
            if (c := self.sessions.get(cid)) is not None and c.current_turn is not None
        )
        if running >= limits.max_concurrent:
            raise LimitError(f"sub-agent refused: max_concurrent {limits.max_concurrent} children already running")
        handler = msg.handler or parent.meta.handler
        allowed = {"agent", "echo", parent.meta.handler, *limits.allowed_handlers}
        if handler not in allowed:
            raise BadRequest(
                f"sub-agent refused: handler {handler!r} is not allowed "
                "([agent.subagents] allowed_handlers)"
            )
        root.spawned += 1
        child = await self.create(
            parent.meta.owner_uid, self._child_id(parent), handler,
            dict(parent.meta.overrides), parent=parent,
        )
        fut: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()

        def register(accepted: m.Accepted) -> None:
            # Called as the input becomes durable, which always precedes the
            # turn's end (a quick child may be done before send() returns).
            child.turn_results[accepted.turn] = fut

        await self.send(child, msg.task, None, register)
        try:
            ok, text = await asyncio.wait_for(asyncio.shield(fut), limits.child_timeout_secs)
        except asyncio.TimeoutError:
            with contextlib.suppress(SessiondError):
                self.interrupt(child)
            raise LimitError(
                f"sub-agent {child.id} did not finish within child_timeout_secs={limits.child_timeout_secs:g}"
            ) from None
        if not ok:
            raise Internal(f"sub-agent {child.id} failed: {text}")
        return text

    # ================================================================ supervision

    async def supervise(self) -> None:
        """The periodic sweep: memory caps, heartbeats, idle hibernation.
        Runs as one task for the daemon's life."""
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while not self._closing:
            interval = self.config.agent.limits.memory_poll_interval_ms / 1000.0
            next_tick = max(next_tick + interval, loop.time())
            await asyncio.sleep(next_tick - loop.time())
            try:
                self.sweep(time.monotonic())
            except Exception:
                log.exception("supervision sweep failed; carrying on")

    def sweep(self, now: float) -> None:
        seen: set[int] = set()
        # Sessions in a turn first: they are the ones whose memory grows,
        # so their figures are the freshest when a cap is crossed.
        ordered = sorted(self.sessions.values(), key=lambda s: s.current_turn is None)
        for session in ordered:
            worker = session.worker
            if worker is None or worker.kill_reason or worker.exited.done():
                continue
            limits = session.settings.agent.limits
            rss = session.memory.measure(self.proc_table, worker.pid)
            seen.add(worker.pid)
            seen.update(session.memory.pids)
            verdict = memory_verdict(rss, limits.max_memory_mb, limits.memory_high_mb, session.memory.high)
            if verdict.kill:
                self._kill_for_limit(
                    session, worker, "killed_memory",
                    f"memory cap {limits.max_memory_mb} MiB exceeded at {rss / MIB:.0f} MiB",
                    "memory", rss / MIB, limits.max_memory_mb,
                )
                continue
            if verdict.high_crossed:
                assert limits.memory_high_mb is not None
                session.memory.high = True
                self._emit_limit(session, "memory_high", rss / MIB, limits.memory_high_mb)
                worker.conn.send(m.MemoryHigh(rss_bytes=rss, limit_bytes=limits.memory_high_mb * MIB))
            elif verdict.high_cleared:
                session.memory.high = False
            hb = session.settings.agent.worker.heartbeat_interval_secs
            silent = now - worker.last_heartbeat
            if worker.booted and silent > 3 * hb:
                self._kill_for_limit(
                    session, worker, "killed_heartbeat",
                    f"no heartbeat for {silent:.1f}s (interval {hb:g}s): its event loop is stuck",
                    "heartbeat", silent, 3 * hb,
                )
                continue
            idle_limit = session.settings.agent.session_timeout_secs
            if (
                session.state is State.IDLE and now - session.last_active > idle_limit
                and session.id not in self._hibernating and not session.lock.locked()
            ):
                self._hibernating.add(session.id)
                self._spawn_task(self._hibernate(session, f"idle for more than {idle_limit:g}s"))
        self.proc_table.keep_only(seen)
        if self._retained_bytes > self.config.daemon.event_retention_total_bytes:
            self._trim_rings()

    def _emit_limit(self, session: Session, kind: str, value: float, limit: float) -> None:
        self._emit(
            session,
            m.LimitExceeded(session=session.id, seq=self._next_seq(session), kind=kind,
                            value=round(value, 3), limit=limit),
        )

    def _kill_for_limit(
        self, session: Session, worker: WorkerProc, reason: str, detail: str,
        kind: str, value: float, limit: float,
    ) -> None:
        log.warning("session %s: %s; killing worker %d", session.id, detail, worker.pid)
        worker.kill_reason = reason
        worker.kill_detail = detail
        self._emit_limit(session, kind, value, limit)
        self.spawner.kill_tree(worker.pid, session.memory.escapees())

    def _on_turn_timeout(self, session: Session, turn: int) -> None:
        session.turn_timer = None
        worker = session.worker
        if session.current_turn != turn or worker is None:
            return
        timeout = session.settings.agent.turn_timeout_secs
        grace = self.config.daemon.stop_grace_secs
        self._emit_limit(session, "turn_timeout", time.monotonic() - session.turn_started, timeout)
        if session.state is State.RUNNING:
            self._set_state(session, Trigger.INTERRUPT, reason=f"turn_timeout_secs={timeout:g} reached")
        worker.conn.send(m.InterruptTurn(turn=turn))
        session.kill_timer = asyncio.get_running_loop().call_later(
            grace, self._on_turn_kill, session, worker, turn, timeout, grace
        )

    def _on_turn_kill(self, session: Session, worker: WorkerProc, turn: int, timeout: float, grace: float) -> None:
        session.kill_timer = None
        if session.current_turn != turn or session.worker is not worker:
            return
        worker.kill_reason = "killed_turn_timeout"
        worker.kill_detail = f"turn {turn} still running {grace:g}s after its timeout of {timeout:g}s"
        log.warning("session %s: %s; killing worker %d", session.id, worker.kill_detail, worker.pid)
        self.spawner.kill_tree(worker.pid, session.memory.escapees())

    async def _hibernate(self, session: Session, reason: str) -> None:
        try:
            async with session.lock:
                if session.state is not State.IDLE or session.worker is None:
                    return
                self._set_state(session, Trigger.HIBERNATE, reason=reason)
                await self._terminate(session, "hibernated", self.config.daemon.stop_grace_secs)
        finally:
            self._hibernating.discard(session.id)

    def _live_count(self, excluding: Session | None = None) -> int:
        return sum(
            1 for s in self.sessions.values()
            if s is not excluding and (s.worker is not None or s.state is State.STARTING)
        )

    async def _make_room(self, session: Session) -> None:
        """Keep live workers within max_concurrent_sessions: hibernate the
        least recently used idle session, or refuse with `capacity`."""
        limit = self.config.agent.limits.max_concurrent_sessions
        while self._live_count(session) >= limit:
            idle = [
                s for s in self.sessions.values()
                if s is not session and s.state is State.IDLE and s.worker is not None
                and not s.lock.locked() and s.id not in self._hibernating
            ]
            if not idle:
                raise Capacity(
                    f"all {limit} live sessions are busy (max_concurrent_sessions); "
                    "try again when a turn ends"
                )
            victim = min(idle, key=lambda s: s.last_active)
            log.info("session %s: hibernating to make room for %s", victim.id, session.id)
            self._hibernating.add(victim.id)
            await self._hibernate(victim, "hibernated to make room (max_concurrent_sessions)")

    def reload(self, config: Config) -> None:
        """New config (SIGHUP): every session, live ones included, runs
        under it from now on, its own overrides pulled back inside the new
        bounds.  What the daemon enforces (memory caps, heartbeats, turn
        timeouts) applies at once; live workers get their new settings, so
        permission rules and the loop's limits apply at the next tool call."""
        self.config = config
        now = time.monotonic()
        for session in self.sessions.values():
            old = session.settings
            session.settings = self._settings_for(session.id, session.meta.overrides)
            session.policy = None
            for _, frame in session.ring:
                self._retained_bytes -= len(frame)
            session.ring = collections.deque(session.ring, maxlen=config.daemon.event_retention)
            session.ring_bytes = sum(len(frame) for _, frame in session.ring)
            self._retained_bytes += session.ring_bytes
            worker = session.worker
            if worker is None or worker.exited.done():
                continue
            # The worker may be asleep for one old interval before it beats
            # at the new pace: do not count that against it.
            worker.last_heartbeat = max(
                worker.last_heartbeat, now + old.agent.worker.heartbeat_interval_secs
            )
            worker.conn.send(m.Reconfigure(settings=_settings_encoder.encode(session.settings)))
            self._retime_turn(session)

    def _retime_turn(self, session: Session) -> None:
        """A running turn under a changed turn_timeout_secs: its deadline is
        counted from its start, and one already past fires now."""
        if session.turn_timer is None or session.current_turn is None:
            return
        session.turn_timer.cancel()
        left = session.settings.agent.turn_timeout_secs - (time.monotonic() - session.turn_started)
        session.turn_timer = asyncio.get_running_loop().call_later(
            max(left, 0.0), self._on_turn_timeout, session, session.current_turn
        )

    # ================================================================ shutdown

    def running_turns(self) -> int:
        return sum(1 for s in self.sessions.values() if s.current_turn is not None)

    async def shutdown(self, grace: float) -> None:
        """Let running turns finish for up to `grace`, then stop every worker.
        Sessions stay on disk and come back hibernated."""
        self._closing = True
        deadline = time.monotonic() + grace
        while self.running_turns() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for session in self.sessions.values():
            if session.restart_handle is not None:
                session.restart_handle.cancel()
        live = [s for s in self.sessions.values() if s.worker is not None]
        await asyncio.gather(
            *(self._terminate(s, "stopped by the daemon's shutdown", self.config.daemon.stop_grace_secs)
              for s in live),
            return_exceptions=True,
        )
        for task in list(self._tasks):
            task.cancel()
        for session in self.sessions.values():
            session.store.close()
        self.proc_table.close()


def _is(session: Session, state: State) -> bool:
    # A call, not an inline `is`: the state changes under awaits and
    # _set_state, which type narrowing cannot see.
    return session.state is state


def _check_handler(name: str, settings: SessionSettings) -> None:
    """A client's --handler: the operator's default, or one the operator
    listed in [agent] allowed_handlers ("module:*" admits a module's
    factories).  Anything else is refused before anything is imported."""
    if not valid_handler_name(name):
        raise BadRequest(f"invalid handler {name!r}: use 'agent', 'echo' or 'package.module:factory'")
    allowed = settings.agent.allowed_handlers
    module = name.partition(":")[0]
    if name == settings.agent.handler or name in allowed or f"{module}:*" in allowed:
        return
    raise BadRequest(
        f"handler {name!r} is not allowed here; the operator allows "
        f"{', '.join(allowed) or 'none'} ([agent] allowed_handlers in config.toml)"
    )


def _store_failure(prefix: str, exc: StoreError) -> SessiondError:
    """A store error as a client hears it: `no_space` for a full disk."""
    if isinstance(exc, StoreFull):
        return NoSpace(f"{prefix}{exc}")
    return Internal(f"{prefix}{exc}")


def _damaged_hint(session: Session) -> str:
    return (
        f"session {session.id} is damaged ({session.error}); `sessionctl repair {session.id} "
        f"--skip-bad` or `--truncate` recovers it, `sessionctl rm {session.id}` deletes it"
    )


def _no_such_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


def _rmtree(path: Path) -> None:
    """Remove a tree that a session's tools may have made hard to remove
    (directories without write or search permission); never follows links."""

    def onerror(func: Any, target: str, exc_info: Any) -> None:
        exc = exc_info[1]
        if isinstance(exc, FileNotFoundError):
            return
        if not isinstance(exc, PermissionError):
            raise exc
        for directory in (os.path.dirname(target), target):
            if os.path.isdir(directory) and not os.path.islink(directory):
                with contextlib.suppress(OSError):
                    os.chmod(directory, 0o700)
        if func in (os.rmdir, os.unlink, os.remove):
            func(target)
        else:  # it could not be opened or listed: now it can
            shutil.rmtree(target, onerror=onerror)

    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    shutil.rmtree(path, onerror=onerror)


def _classify(worker: WorkerProc, code: int | None, sig: int | None) -> str:
    if worker.expected:
        return "stopped"
    if worker.kill_reason:
        return worker.kill_reason
    if not worker.booted or code == EXIT_BOOT_FAILED:
        return "boot_failed"
    if code == 0:
        return "exited"
    return "crashed"


def _describe_exit(info: m.ExitInfo | None) -> str:
    """e.g. "killed_memory: memory cap 64 MiB exceeded at 131 MiB (signal SIGKILL)"."""
    if info is None:
        return "no exit recorded"
    how = f"signal {_signame(info.signal)}" if info.signal else f"exit code {info.code}"
    return f"{info.reason}: {info.detail} ({how})" if info.detail else f"{info.reason} ({how})"


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)
