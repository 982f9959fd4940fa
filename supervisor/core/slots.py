"""Live slots: how many sessions may hold a worker at once, daemon-wide
([agent.limits] max_concurrent_sessions) and per owner ([daemon]
max_live_sessions_per_uid), and whom to hibernate to make room.

Runs in the daemon's loop.  A session that needs a worker first fits under
its owner's ceiling (hibernating the owner's own least recently used idle
session, else `capacity` naming the per-uid limit), then under the
daemon-wide one (hibernating anyone's least recently used idle session,
else `capacity`).  So one user whose sessions all sleep in turns holds at
most its ceiling, and the other slots stay for everyone else.  Admins
(root, [daemon] admin_uids) have no per-uid ceiling, as they have no
session quota.

Hibernation ahead of demand (`hibernate_ahead`, after every start that
took a slot and at every sweep): once there are more sessions than live
slots, fewer free slots than `free_slots_low_water_pct` of the ceiling
have the least recently used idle sessions that no client is attached to
hibernated in the background, up to `free_slots_high_water_pct`; so a
create or a revive usually finds a free slot and does not wait for
another session's worker to stop (make_room's own eviction stays, for a
burst that outruns it).  The high mark never takes the live sessions
below one uid's whole per-uid ceiling.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from supervisor.config import Config
from supervisor.core.fdbudget import FdBudget
from supervisor.errors import Capacity
from supervisor.logtag import tagged
from supervisor.core.registry import Registry
from supervisor.core.session import Session
from supervisor.core.events import EventLog
from supervisor.core.states import State, Trigger

__all__ = ["LiveSlots", "per_uid_ceiling"]

log = logging.getLogger("sessiond.manager")


def per_uid_ceiling(config: Config, total: int | None = None) -> int:
    """[daemon] max_live_sessions_per_uid, 0 meaning half of the daemon-wide
    live ceiling (`total`: max_concurrent_sessions as the fds clamp it;
    rounded up), never above it."""
    total = config.agent.limits.max_concurrent_sessions if total is None else total
    own = config.daemon.max_live_sessions_per_uid or (total + 1) // 2
    return max(1, min(own, total))


class LiveSlots:
    def __init__(self, config: Callable[[], Config], sessions: Registry,
                 is_admin: Callable[[int], bool], events: EventLog,
                 spawn_task: Callable[[Coroutine[Any, Any, None]], None], fds: FdBudget | None = None, *,
                 terminate: Callable[[Session, str, float], Awaitable[None]]) -> None:
        self._config = config
        self.fds = fds  # None: not measured (tests of the manager alone)
        self._sessions = sessions
        self._is_admin = is_admin
        self._events = events
        self._spawn_task = spawn_task
        # WorkerOwner.terminate (built after this: the manager's lambda reads it at call time).
        self._terminate = terminate
        self._hibernating: set[str] = set()  # ids of the sessions on their way to hibernation
        # make_room's waits for a hibernation on its way to free a slot:
        # woken by any slot freed (`slot_freed`: a stop, a crash, a removal
        # as well).
        self._freed: list[asyncio.Future[None]] = []

    def count(self, excluding: Session | None = None, uid: int | None = None) -> int:
        """Sessions holding a live slot (a worker, or one starting): kept by the registry, never walked."""
        return self._sessions.live_count(uid, excluding)

    def _live(self, excluding: Session | None, uid: int | None) -> Iterator[Session]:
        return (s for s in list(self._sessions.live)
                if s is not excluding and (uid is None or s.meta.owner_uid == uid))

    def ceiling(self) -> int:
        """Live sessions at most, daemon-wide."""
        cfg = self._config()
        return self.fds.live_ceiling(cfg) if self.fds is not None else cfg.agent.limits.max_concurrent_sessions

    def check_fds(self) -> None:
        """`capacity` naming file descriptors unless one more session can start."""
        if self.fds is not None:
            self.fds.check(self.count())

    def has_room(self, uid: int) -> bool:
        if not self._is_admin(uid) and self.count(uid=uid) >= per_uid_ceiling(self._config(), self.ceiling()):
            return False
        return self.count() < self.ceiling()

    async def make_room(self, session: Session) -> None:
        """Keep `session`'s owner under its ceiling and live workers under
        max_concurrent_sessions: hibernate the least recently used idle
        session (the owner's own for its ceiling), or refuse with `capacity`."""
        uid = session.meta.owner_uid
        if not self._is_admin(uid):
            while self.count(session, uid) >= (ceiling := per_uid_ceiling(self._config(), self.ceiling())):
                victim = self._idle(session, uid)
                if victim is not None:
                    await self._evict(victim, session, "max_live_sessions_per_uid")
                elif self._on_their_way(uid):
                    await self._one_freed()
                else:
                    raise Capacity(
                        f"uid {uid} already has {ceiling} live sessions, all busy ([daemon] "
                        "max_live_sessions_per_uid); try again when one of its turns ends"
                    )
        while self.count(session) >= (limit := self.ceiling()):
            victim = self._idle(session, None)
            if victim is not None:
                await self._evict(victim, session, "max_concurrent_sessions")
            elif self._on_their_way(None):
                await self._one_freed()
            else:
                setting = self.fds.busy_refusal(self._config()) if self.fds else "max_concurrent_sessions"
                raise Capacity(f"all {limit} live sessions are busy ({setting}); try again when a turn ends")
        self.check_fds()  # after evictions: a hibernated session's fds are closed
        self.hibernate_ahead()

    def water_marks(self) -> tuple[int, int]:
        """(low, high): the free live slots below which idle sessions are
        hibernated ahead of demand, and up to which; (0, 0) when none are."""
        cfg = self._config()
        limits, ceiling = cfg.agent.limits, self.ceiling()
        room = ceiling - per_uid_ceiling(cfg, ceiling)  # one uid keeps its whole share
        # (rounded down: a small ceiling keeps none free, as before)
        high = min(ceiling * limits.free_slots_high_water_pct // 100, room)
        low = min(ceiling * limits.free_slots_low_water_pct // 100, high)
        return (low, high) if low > 0 else (0, 0)

    def hibernate_ahead(self) -> None:
        """Below the low water mark of free slots, with more sessions than
        slots: idle sessions no client is attached to, least recently used
        first, hibernated in the background up to the high mark.  O(1) above
        the mark; else one pass over the live sessions."""
        low, high = self.water_marks()
        ceiling = self.ceiling()
        # (those on their way to hibernation count as free already)
        free = ceiling - self.count() + len(self._hibernating)
        if not low or free >= low or len(self._sessions) <= ceiling:
            return
        idle = (s for s in self._sessions.live if s.state is State.IDLE and s.worker is not None
                and not s.subscribers and not s.lock_held and s.id not in self._hibernating)
        for victim in heapq.nsmallest(high - free, idle, key=lambda s: s.last_active):
            tagged(log, victim.id).info("hibernating ahead of demand: %d of %d live slots free "
                                        "(free_slots_low_water_pct)", free, ceiling)
            self.hibernate_soon(victim, "hibernated ahead of demand (free_slots_low_water_pct)")

    def _idle(self, session: Session, uid: int | None) -> Session | None:
        idle = [
            s for s in self._live(session, uid)
            if s.state is State.IDLE and s.worker is not None
            and not s.lock_held and s.id not in self._hibernating
        ]
        return min(idle, key=lambda s: s.last_active) if idle else None

    def _on_their_way(self, uid: int | None) -> bool:
        """Whether a session (of `uid`'s) is on its way to hibernation: its
        slot is about to be free.  Creates side by side each take an idle
        session to hibernate; one that found all of them taken so was told
        `all live sessions are busy` a moment before slots came free (20
        users creating at once, 200 slots: most creates were refused)."""
        return any(uid is None or (s := self._sessions.get(sid)) is not None and s.meta.owner_uid == uid
                   for sid in self._hibernating)

    async def _one_freed(self) -> None:
        """Until a slot is freed (by the hibernation on its way, or any
        other way), or that hibernation ended with its session busy again:
        the caller counts again."""
        freed = asyncio.get_running_loop().create_future()
        self._freed.append(freed)
        await freed

    async def _evict(self, victim: Session, session: Session, limit: str) -> None:
        tagged(log, victim.id).info("hibernating to make room for session=%s (%s)", session.id, limit)
        self._hibernating.add(victim.id)
        await self.hibernate(victim, f"hibernated to make room ({limit})")

    # ---------------------------------------------------------------- hibernation

    def hibernate_soon(self, session: Session, reason: str) -> None:
        """In the background (ahead of demand, the sweep's idle timeout)."""
        if session.id not in self._hibernating:
            self._hibernating.add(session.id)
            self._spawn_task(self.hibernate(session, reason))

    async def hibernate(self, session: Session, reason: str) -> None:
        """An idle session's worker stopped, its slot freed; it revives at its next input."""
        try:
            async with session.locked():
                if session.state is not State.IDLE or session.worker is None:
                    return
                self._events.set_state(session, Trigger.HIBERNATE, reason=reason)
                await self._terminate(session, "hibernated", self._config().daemon.stop_grace_secs)
        finally:
            self._hibernating.discard(session.id)
            self.slot_freed()  # (or it was busy again: the waiters count again all the same)

    def slot_freed(self) -> None:
        """A session stopped holding a live slot (the registry says): the
        creates waiting for one count again."""
        if not self._freed:
            return
        freed, self._freed = self._freed, []
        for waiter in freed:
            if not waiter.done():
                waiter.set_result(None)
