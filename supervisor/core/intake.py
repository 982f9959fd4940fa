"""How sessions come into the daemon's registry and go out of it: a new one
created (checked, its worker ordered first, stored, booted; a failure leaves
nothing behind), a stored one restored (at start, after a repair, imported,
adopted from another daemon), a damaged one kept visible, and the registry
and its parent's list left.

Runs in the daemon's loop.  The registry (`sessions`) and a parent's
`children` are the manager's (supervisor.core.session's table); `Intake`
keeps them on its behalf, as `SessionManager` builds it.  A client's
request reaches it through the manager's `create`, `import_session`
(supervisor.core.imports) and `load_all`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgspec

from ipc import messages as m
from ipc.settings import SessionSettings
from supervisor.config import Config
from supervisor.errors import BadRequest, Capacity, Conflict, SessiondError
from supervisor.core.admission import Admission
from supervisor.core.budgets import Budgets
from supervisor.core.events import EventLog
from supervisor.core import imports
from supervisor.core.fdbudget import out_of_fds
from supervisor.core.ledger import TurnLedger, store_failure
from supervisor.core.loading import Loader, Opener
from supervisor.core.resumable import ResumableTurns
from supervisor.logtag import tagged
from supervisor.core.overrides import OverrideError, choose_handler, resolve_overrides
from supervisor.core.registry import Registry
from supervisor.spawn.seams import Pending, Spawner, drop_pending
from supervisor.core.session import Session, valid_session_id
from supervisor.core.subagents import child_prefix
from supervisor.core.slots import LiveSlots
from supervisor.core.states import State
from supervisor.store.state_store import DamagedLog, LoadedSession, Meta, SessionLog, StateStore, StoreDamaged, StoreError
from supervisor.core.workers import WorkerOwner
from supervisor.core.workspaces import Workspaces

__all__ = ["Intake"]

log = logging.getLogger("sessiond.manager")


class Intake:
    def __init__(
        self,
        config: Callable[[], Config],
        sessions: Registry,
        store: StateStore,
        events: EventLog,
        ledger: TurnLedger,
        resumable: ResumableTurns,
        workers: WorkerOwner,
        workspaces: Workspaces,
        slots: LiveSlots,
        spawner: Spawner,
        budgets: Budgets,
        admission: Admission,
        spawn_task: Callable[[Coroutine[Any, Any, None]], None],
        *,
        state_dir: Path,
        open_stored: Callable[[str], tuple[SessionLog, LoadedSession]],
        closing: Callable[[], bool],
        remove: Callable[[Session], Coroutine[Any, Any, None]],
        list_ids: Callable[[], list[str]] | None = None,
        read_stored: Callable[[str], Opener] | None = None,
    ) -> None:
        self._config = config
        self._sessions = sessions
        self._store = store
        self._events = events
        self._ledger = ledger
        self._resumable = resumable
        self._workers = workers
        self._workspaces = workspaces
        self._slots = slots
        self._spawner = spawner
        self._budgets = budgets
        self._admission = admission
        self._spawn_task = spawn_task
        self._sessions_dir = state_dir / "sessions"
        # How a stored session is opened at start: claimed (alone), or read (supervisor.cluster.fronts).
        self._open_stored = open_stored
        # The daemon is shutting down: nothing new is created (SessionManager's).
        self._closing = closing
        # SessionManager.remove: an `rm` the daemon died in, finished at load.
        self._remove = remove
        # Children loaded before their parent, by the parent's id (linked when it is loaded).
        self._orphans: dict[str, list[str]] = {}
        # Who runs as which uid, of the sessions not damaged at their load (stored_problem's check).
        self._run_uids: dict[int, str] = {}
        # The sessions on disk, listed at start and loaded in the background or when asked for.
        self.loading = Loader(list_ids or store.ids, open_stored, read_stored, self.load_one, self._loaded,
                              closing)

    # ---------------------------------------------------------------- from the store

    def load_all(self) -> None:
        """Restore every session on disk now; live ones come back hibernated."""
        self._open_dirs()
        self.loading.list_stored()
        self.loading.load_everything_now()

    def start_loading(self) -> int:
        """List the sessions on disk and load them in the background
        (supervisor.core.loading); returns how many are listed."""
        self._open_dirs()
        listed = self.loading.list_stored()
        self._spawn_task(self.loading.run())
        return listed

    def _open_dirs(self) -> None:
        # Workers running as another user must reach their workspace:
        # traverse (not list) the state dir; sessions/ stays private.
        self._workspaces.open_dirs(self._sessions_dir)

    def load_one(self, session_id: str, open_: Opener) -> None:
        """One stored session into the registry: restored, or damaged.
        `capacity` (and still on disk, unloaded) where the daemon is out of
        fds: that says nothing of the session."""
        try:
            store, loaded = open_()
        except KeyError:
            return  # gone, or a create cut short before it was acknowledged
        except StoreDamaged as exc:
            self.add_damaged(session_id, exc.reason, exc.meta)
            return
        except Exception as exc:
            if (refusal := out_of_fds(exc, f"session {session_id} could not be loaded: ")) is not None:
                raise refusal from None
            self.add_damaged(session_id, f"cannot be loaded: {exc}", None)
            return
        try:
            self.restore(store, loaded)
        except Exception as exc:
            store.close()
            self.add_damaged(session_id, f"cannot be restored: {exc}", loaded.meta)

    def _loaded(self) -> None:
        """Every session on disk is in the registry."""
        if self._sessions:
            log.info("restored %d session(s) from %s", len(self._sessions), self._sessions_dir)
        self._orphans.clear()  # (children whose parent is on disk no more)
        self._workspaces.remove_orphans(self._sessions.values())

    @property
    def sessions(self) -> Registry:
        return self._sessions

    async def import_session(self, owner_uid: int, session_id: str | None, doc: imports.Imported,
                             free: Callable[[list[Any]], None]) -> Session:
        """A session from an export, admitted as `create` admits one."""
        return await imports.admit(self, self._store, self._budgets, self._config(), self._closing,
                                   owner_uid, session_id, doc, free)

    def restore(self, store: SessionLog, loaded: LoadedSession) -> None:
        """A stored session into the registry (at start, on import, adopted from another daemon)."""
        meta = loaded.meta
        if (bad := self._workspaces.stored_problem(meta, self._same_uid(meta))) is not None:
            store.close()  # checked again as on create: a store's values are data
            self.add_damaged(meta.id, bad[0], meta if bad[1] else None)
            return
        mark = loaded.mark
        state = {"stopped": State.STOPPED, "failed": State.FAILED}.get(mark.state, State.HIBERNATED)
        session = Session(
            id=meta.id, meta=meta, store=store, settings=self.settings_for(meta.id, meta.overrides),
            state=state, turns=loaded.turns, seq=loaded.seq, reserved_seq=loaded.seq,
            restarts=mark.restarts,
            last_exit=msgspec.convert(mark.last_exit, m.ExitInfo) if mark.last_exit else None,
            usage=loaded.usage, lifecycle=self._events.restored_lifecycle(loaded.lifecycle),
        )
        if loaded.open_input is not None and not self._resumable.suspend_stored(session, loaded):
            self._ledger.abort_stored(session, store, loaded.open_input.turn, "the daemon stopped during this turn",
                                     durable=True)
        self._enter(session)
        self._budgets.restored(session)
        if mark.state == "removing":  # a `rm` the daemon died in: finished now
            self._spawn_task(self._remove(session))
        elif session.suspended is not None:  # the turn the daemon died in resumes on a new worker
            self._workers.schedule_restart(session)

    def add_damaged(self, session_id: str, reason: str, meta: Meta | None) -> None:
        """A session whose stored state does not load stays visible (ls,
        status: state "damaged" with the reason) and removable, and keeps
        its id taken, its files untouched, until repaired or removed.
        Without readable metadata only admins see it (owner uid 0)."""
        tagged(log, session_id).error("is damaged and was not restored: %s", reason)
        session = Session(
            id=session_id, meta=meta or Meta(id=session_id, handler="?"),
            store=DamagedLog(self._store, session_id, reason),
            settings=self._config().session_settings(), state=State.DAMAGED,
            error=reason, meta_lost=meta is None,
        )
        self._enter(session)

    def _enter(self, session: Session) -> None:
        """Into the registry, and its parent's list and its children into
        its own whatever the order they are loaded in (a child may be
        loaded first: a request named it, or its id sorts first)."""
        self._sessions[session.id] = session
        if (uid := session.meta.run_uid) is not None and not session.is_(State.DAMAGED):
            self._run_uids[uid] = session.id
        parent_id = session.meta.parent
        if parent_id:
            parent = self._sessions.get(parent_id)
            if parent is not None:
                parent.children = (*parent.children, session.id)
            else:
                self._orphans.setdefault(parent_id, []).append(session.id)
        for child_id in self._orphans.pop(session.id, []):
            child = self._sessions.get(child_id)
            if child is not None and child.meta.parent == session.id and child_id not in session.children:
                session.children = (*session.children, child_id)

    def _same_uid(self, meta: Meta) -> list[Session]:
        """The session (not damaged when it came in) that runs as `meta`'s
        uid, if another does: what stored_problem checks, without a walk of
        every session for each one loaded."""
        holder = self._sessions.get(self._run_uids.get(meta.run_uid, "")) if meta.run_uid is not None else None
        return [holder] if holder is not None and holder.meta.run_uid == meta.run_uid else []

    def children(self, session: Session) -> list[str]:
        """Its children's ids, those not loaded yet loaded first (a `stop`
        or `rm` of it reaches them all)."""
        self.loading.load_prefixed(child_prefix(session.id))
        return list(session.children)

    def settings_for(self, session_id: str, overrides: dict[str, Any]) -> SessionSettings:
        """A stored session's settings under the current config: overrides
        that no longer fit are pulled back inside the operator's bounds."""
        resolved = resolve_overrides(self._config().session_settings(), overrides, strict=False)
        for line in resolved.adjusted:
            tagged(log, session_id).warning("%s", line)
        return resolved.settings

    # ---------------------------------------------------------------- new

    def check_quota(self, uid: int) -> None:
        self._slots.check_fds()  # before a new session's files are opened
        limit = self._config().daemon.max_sessions_per_uid
        held = self._sessions.owned(uid)  # (counted by the registry: no walk of every session)
        if held >= limit and not self._admission.is_admin(uid):
            raise Capacity(
                f"uid {uid} already has {held} sessions (max_sessions_per_uid = {limit}); "
                "remove some with `sessionctl rm`"
            )

    async def create(
        self,
        owner_uid: int,
        session_id: str | None, handler: str | None,
        overrides: dict[str, Any],
        *,
        parent: Session | None = None,
    ) -> Session:
        """A new session, booted: checked, its worker ordered, registered
        and stored, then started; a failure leaves nothing behind."""
        if self._closing():
            raise Conflict("the daemon is shutting down")
        session_id = self._free_id(session_id)
        if self.loading.progress is not None:
            # The per-uid quota and the session uids count every session.
            await self.loading.wait("a create")
            session_id = self._free_id(session_id)
        self.check_quota(owner_uid)
        if parent is not None:
            # The parent's own overrides, accepted when it was created, held
            # to today's ceilings.
            settings = self.settings_for(session_id, overrides)
        else:
            try:
                settings = resolve_overrides(self._config().session_settings(), overrides).settings
            except OverrideError as exc:
                raise BadRequest(str(exc)) from exc
        handler = choose_handler(handler, settings, checked=parent is not None)
        # Order the worker first: the zygote forks (or hands over a spare)
        # while this process fsyncs the new session to disk.
        pending = self._spawner.request() if self._slots.has_room(owner_uid) else None
        session = self._register(owner_uid, session_id, handler, overrides, settings, parent, pending)
        await self._boot_new(session, pending)
        tagged(log, session_id).info("created (handler %s, pid %s)", handler,
                                     session.worker.pid if session.worker else "-")
        return session

    def _free_id(self, session_id: str | None) -> str:
        """The id asked for, checked and free, or a new one."""
        if session_id is None:
            while (new := secrets.token_hex(6)) in self._sessions or self.loading.listed(new):
                pass
            return new
        if not valid_session_id(session_id):
            raise BadRequest(f"invalid session id {session_id!r}: 1-64 characters of A-Z a-z 0-9 . _ -, "
                             "starting with a letter or digit")
        self.loading.load_now(session_id)  # (one on disk not loaded yet is)
        if (existing := self._sessions.get(session_id)) is not None:
            if existing.state is State.DAMAGED:
                raise Conflict(f"session {session_id!r} already exists and is damaged "
                               f"({existing.error}); `sessionctl rm {session_id}` frees the id")
            raise Conflict(f"session {session_id!r} already exists")
        return session_id

    def _register(self, owner_uid: int, session_id: str, handler: str, overrides: dict[str, Any],
                  settings: SessionSettings, parent: Session | None, pending: Pending | None) -> Session:
        """Its metadata stored (not yet durable) and the session in the registry, STARTING."""
        meta = self.new_meta(session_id, handler, overrides, owner_uid, time.time(), parent)
        try:
            # Durable while the worker boots (`_boot_new`): the create is
            # answered only once both are done.
            store = self._store.create(meta, durable=False)
        except FileExistsError as exc:
            drop_pending(self._spawner, pending)
            raise Conflict(f"session {session_id!r} already exists") from exc
        except StoreError as exc:
            drop_pending(self._spawner, pending)
            raise store_failure("", exc) from None  # unchained: a database's error may quote its DSN
        session = Session(id=session_id, meta=meta, store=store, settings=settings, state=State.STARTING)
        self._enter(session)
        return session

    def new_meta(self, session_id: str, handler: str, overrides: dict[str, Any], owner_uid: int,
                 created_at: float, parent: Session | None = None) -> Meta:
        """A new session's metadata (created, or imported by supervisor.api.transfer)."""
        return Meta(
            id=session_id, handler=handler, overrides=overrides, created_at=created_at, owner_uid=owner_uid,
            parent=parent.id if parent else None, depth=parent.meta.depth + 1 if parent else 0,
            # Never the same directory twice: a later session that reuses
            # this id, whoever creates it, starts with an empty workspace.
            workspace=f"{session_id}@{secrets.token_hex(8)}",
            run_uid=self._workspaces.allocate_uid(self._sessions.run_uids),
        )

    async def _boot_new(self, session: Session, pending: Pending | None) -> None:
        try:
            async with session.locked():
                await self._workers.start(session, pending, during_boot=session.store.make_durable_soon)
        except StoreError as exc:
            self._discard(session)
            raise store_failure(f"session {session.id!r} could not be saved: ", exc) from None
        except SessiondError as exc:
            # A create that cannot boot leaves nothing behind.
            self._discard(session)
            raise type(exc)(f"session {session.id!r} could not start: {exc.message}") from None
        except BaseException:
            self._discard(session)
            raise

    def _discard(self, session: Session) -> None:
        """A create that failed: nothing of it stays, not even in its parent's list."""
        self._workers.kill_discarded(session)
        self.drop(session)
        try:
            self._workspaces.remove(session)
        except OSError as exc:
            tagged(log, session.id).warning("its workspace could not be removed: %s", exc)

    def drop(self, session: Session) -> asyncio.Future[None]:
        """Out of the registry and of the store (its removal behind its writes)."""
        self.forget(session)
        self._budgets.forget(session.id)  # (its uid's total keeps what it spent)
        return session.store.remove_soon()  # behind its writes; `rm` is answered once it is done

    # ---------------------------------------------------------------- out

    def forget(self, session: Session) -> None:
        """Out of the registry (repaired into a new one, or removed by
        another daemon), and out of its parent's list.  Children it still
        has go to the next session of its id (a repair's) as they would
        at the next start."""
        if self._sessions.get(session.id) is session:
            self._sessions.pop(session.id)
            if session.children:
                self._orphans[session.id] = list(session.children)
            if (uid := session.meta.run_uid) is not None and self._run_uids.get(uid) == session.id:
                del self._run_uids[uid]
        parent = self._sessions.get(session.meta.parent or "")
        if parent is not None and session.id in parent.children:
            parent.children = tuple(c for c in parent.children if c != session.id)
        self._events.forget(session)
