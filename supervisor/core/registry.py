"""The registry: every session by id, and the counts that would otherwise
take a walk of all of them.

Runs in the daemon's loop.  `Registry` is the manager's `sessions`, a dict
by id (written by `Intake` on the manager's behalf: supervisor.core.session's
table), which keeps, as sessions come and go:

- how many sessions each owner holds (`owned`: max_sessions_per_uid);
- the run uids in use (`run_uids`: a new session gets one no session holds);
- the live sessions: those holding a live slot, because they have a worker
  or are starting one (`live`, `live_count`, per owner).  LiveSlots makes
  room among them, the sweep walks them, the live counts are theirs.

Whether a session is live follows from fields two parts own (its state,
EventLog's; its worker, WorkerOwner's): each tells the registry after it
changes one (`relive`), and the holder of a claimed-back session after its
metadata changed (`meta_changed`).  So a create, a revive and a sweep cost
what the live sessions cost, never a walk of the sessions at rest, whose
number may be in the hundreds of thousands.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Container
from typing import Any, NoReturn

from supervisor.core.session import Session
from supervisor.core.states import State
from supervisor.store.state_store import Meta

__all__ = ["Registry"]


def _less(counts: Counter[Any], key: Any) -> None:
    if counts[key] <= 1:
        del counts[key]  # (no key left behind per uid that once held a session)
    else:
        counts[key] -= 1


class Registry(dict[str, Session]):
    """`dict[str, Session]` whose writes (`[id] = session`, `pop`, `del`)
    keep the counts; the other writes of a dict are refused."""

    __slots__ = ("_owned", "_run_uids", "_live", "_live_by_uid", "_on_slot_freed")

    def __init__(self, on_slot_freed: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._owned: Counter[int] = Counter()
        self._run_uids: Counter[int | None] = Counter()
        # Live sessions, each with the owner it is counted for (its meta may be replaced meanwhile).
        self._live: dict[Session, int] = {}
        self._live_by_uid: Counter[int] = Counter()
        # Called when a session stops holding a live slot (LiveSlots wakes
        # the creates waiting for one).
        self._on_slot_freed = on_slot_freed

    # ---------------------------------------------------------------- the registry's writes

    def __setitem__(self, session_id: str, session: Session) -> None:
        old = self.get(session_id)
        if old is not None:
            self._left(old)
        super().__setitem__(session_id, session)
        self._owned[session.meta.owner_uid] += 1
        self._run_uids[session.meta.run_uid] += 1
        self.relive(session)

    def __delitem__(self, session_id: str) -> None:
        session = self[session_id]
        super().__delitem__(session_id)
        self._left(session)

    def pop(self, session_id: str, *default: Any) -> Any:
        if session_id not in self:
            if default:
                return default[0]
            raise KeyError(session_id)
        session = self[session_id]
        del self[session_id]
        return session

    def _left(self, session: Session) -> None:
        _less(self._owned, session.meta.owner_uid)
        _less(self._run_uids, session.meta.run_uid)
        self._not_live(session)

    def _refused(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("the registry is written by [id] = session, pop and del only (its counts follow them)")

    update = setdefault = popitem = clear = __ior__ = _refused

    # ---------------------------------------------------------------- what changes membership

    def relive(self, session: Session) -> None:
        """After its state or its worker changed: live while it has a
        worker or is starting one (and is registered)."""
        live = (session.worker is not None or session.state is State.STARTING) and self.get(session.id) is session
        if live and session not in self._live:
            uid = session.meta.owner_uid
            self._live[session] = uid
            self._live_by_uid[uid] += 1
        elif not live and session in self._live:
            self._not_live(session)

    def meta_changed(self, session: Session, old: Meta) -> None:
        """Its metadata was replaced (claimed back from another daemon's
        store): counted under what it says now."""
        if self.get(session.id) is not session:
            return
        _less(self._owned, old.owner_uid)
        _less(self._run_uids, old.run_uid)
        self._owned[session.meta.owner_uid] += 1
        self._run_uids[session.meta.run_uid] += 1

    def _not_live(self, session: Session) -> None:
        uid = self._live.pop(session, None)
        if uid is not None:
            _less(self._live_by_uid, uid)
            self._on_slot_freed()

    # ---------------------------------------------------------------- counts

    def owned(self, uid: int) -> int:
        """Sessions `uid` owns, whatever their state."""
        return self._owned.get(uid, 0)

    @property
    def run_uids(self) -> Container[int | None]:
        """The run uids sessions hold (`in`)."""
        return self._run_uids

    @property
    def live(self) -> Collection[Session]:
        """The live sessions (a view: copy it before an await)."""
        return self._live.keys()

    def is_live(self, session: Session) -> bool:
        return session in self._live

    def live_count(self, uid: int | None = None, excluding: Session | None = None) -> int:
        """Live sessions (`uid`'s, or all), `excluding` one."""
        count = len(self._live) if uid is None else self._live_by_uid.get(uid, 0)
        if excluding is not None and (counted := self._live.get(excluding)) is not None \
                and (uid is None or counted == uid):
            count -= 1
        return count
