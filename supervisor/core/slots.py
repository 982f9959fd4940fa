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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from supervisor.config import Config
from supervisor.core.fdbudget import FdBudget
from supervisor.errors import Capacity
from supervisor.logtag import tagged
from supervisor.core.session import Session
from supervisor.core.states import State

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
    def __init__(self, config: Callable[[], Config], sessions: dict[str, Session],
                 is_admin: Callable[[int], bool], hibernating: set[str],
                 hibernate: Callable[[Session, str], Awaitable[None]], fds: FdBudget | None = None) -> None:
        self._config = config
        self.fds = fds  # None: not measured (tests of the manager alone)
        self._sessions = sessions
        self._is_admin = is_admin
        self._hibernating = hibernating
        self._hibernate = hibernate

    def count(self, excluding: Session | None = None, uid: int | None = None) -> int:
        return sum(1 for s in self._live(excluding, uid))

    def _live(self, excluding: Session | None, uid: int | None) -> Iterable[Session]:
        return (
            s for s in self._sessions.values()
            if s is not excluding and (s.worker is not None or s.state is State.STARTING)
            and (uid is None or s.meta.owner_uid == uid)
        )

    def ceiling(self) -> int:
        """Live sessions at most, daemon-wide."""
        cfg = self._config()
        return self.fds.live_ceiling(cfg) if self.fds is not None else cfg.agent.limits.max_concurrent_sessions

    def check_fds(self) -> None:
        """`capacity` naming file descriptors unless one more session can start."""
        if self.fds is not None:
            self.fds.check()

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
                if victim is None:
                    raise Capacity(
                        f"uid {uid} already has {ceiling} live sessions, all busy ([daemon] "
                        "max_live_sessions_per_uid); try again when one of its turns ends"
                    )
                await self._evict(victim, session, "max_live_sessions_per_uid")
        while self.count(session) >= (limit := self.ceiling()):
            victim = self._idle(session, None)
            if victim is None:
                setting = self.fds.busy_refusal(self._config()) if self.fds else "max_concurrent_sessions"
                raise Capacity(f"all {limit} live sessions are busy ({setting}); try again when a turn ends")
            await self._evict(victim, session, "max_concurrent_sessions")
        self.check_fds()  # after evictions: a hibernated session's fds are closed

    def _idle(self, session: Session, uid: int | None) -> Session | None:
        idle = [
            s for s in self._live(session, uid)
            if s.state is State.IDLE and s.worker is not None
            and not s.lock.locked() and s.id not in self._hibernating
        ]
        return min(idle, key=lambda s: s.last_active) if idle else None

    async def _evict(self, victim: Session, session: Session, limit: str) -> None:
        tagged(log, victim.id).info("hibernating to make room for session=%s (%s)", session.id, limit)
        self._hibernating.add(victim.id)
        await self._hibernate(victim, f"hibernated to make room ({limit})")
