"""What holds a session's processes besides its worker's tree: its cgroup
(or, without one, its own uid), each owner's share of the daemon's
ceilings, and the kernel's OOM kills, told by the ceiling they were for.

Runs in the daemon's loop, for `WorkerOwner` (supervisor.core.workers),
which builds it and asks it at a worker's start, exit and release.  The
cgroup's own plumbing is supervisor.spawn.cgroups*; the ceilings and the
per-user shares are supervisor.spawn.ceilings.

An OOM kill is reported as what it was (`killed_memory`, its detail naming
the ceiling, and `LimitExceeded{kind="memory", ceiling}`):

- the session's own cap (`max_memory_mb`): the session dies whole;
- its owner's share (`[daemon] max_memory_mb_per_uid`): v1 holds the user's
  processes at the share and the daemon kills the user's largest session
  (no other user's); v2's kernel kills in the user's sessions (each whole);
- the daemon's own ceiling (the unit's `MemoryMax`, the host's memory): the
  kernel killed a process of the session; the session dies whole, told so,
  never that it met its own cap.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable

from ipc.contract import ExitReason, LimitKind, figure_past
from supervisor.config import Config
from supervisor.core.events import EventLog
from supervisor.core.limits import MIB
from supervisor.host.proctable import REMOTE_PIDS
from supervisor.core.session import Session, WorkerProc
from supervisor.core.workspaces import Workspaces
from supervisor.errors import Capacity
from supervisor.logtag import tagged
from supervisor.spawn.ceilings import Ceilings, read_ceilings, user_shares
from supervisor.spawn.cgroups import Cgroups, OomMark, OomWatch, Shares
from supervisor.spawn.pidfd import kill_uid

__all__ = ["Containment"]

log = logging.getLogger("sessiond.manager")

# After an OOM notification, look for the kernel's kill this often, this
# many times (it reclaims first, and may find enough).
_OOM_CHECK_SECS = 0.02
_OOM_CHECKS = 50
_SHARE_KEY = "daemon.max_memory_mb_per_uid"


class Containment:
    def __init__(
        self,
        config: Callable[[], Config],
        cgroups: Cgroups | None,
        workspaces: Workspaces,
        events: EventLog,
        kill: Callable[[Session, WorkerProc, ExitReason, str], None],
        live: Callable[[], Iterable[Session]],
    ) -> None:
        self._config = config
        self.cgroups = cgroups
        self._workspaces = workspaces
        self._events = events
        self._kill = kill  # WorkerOwner.kill: the one kill path
        self._live = live  # the sessions with a worker
        # Per session: the kernel's OOM counters when its worker was
        # attached (what is more is this worker's), and the OOM fd watched.
        self._oom_seen: dict[str, OomMark] = {}
        self._oom = OomWatch()
        # The daemon's ceilings (the unit's TasksMax and MemoryMax), read once.
        self.ceilings: Ceilings | None = None
        if cgroups is not None:
            self.ceilings = read_ceilings()
            share = self.share()
            log.info("each owner uid's share of the daemon's ceilings: %d tasks (of %d, %s), %d MiB (of %d MiB, "
                     "%s) ([daemon] max_processes_per_uid, max_memory_mb_per_uid)",
                     share.processes, self.ceilings.tasks.limit, self.ceilings.tasks.where, share.memory_mb,
                     self.ceilings.memory.limit // MIB, self.ceilings.memory.where)

    def share(self) -> Shares:
        """One owner uid's share now (the config may have been reloaded)."""
        assert self.ceilings is not None
        cfg = self._config().daemon
        return user_shares(cfg.max_processes_per_uid, cfg.max_memory_mb_per_uid, self.ceilings)

    def check_room(self, session: Session) -> None:
        """Refuse (capacity) a worker whose owner holds its share of tasks:
        it could not start its tools, and the share is not to be passed."""
        if self.cgroups is None:
            return
        why = self.cgroups.user_room(session.meta.owner_uid)
        if why:
            raise Capacity(why)

    def attach(self, session: Session, pid: int) -> None:
        """The worker into its session's cgroup (under its owner's uid and
        share), and the cgroup's OOM notification watched."""
        assert self.cgroups is not None
        limits = session.settings.agent.limits
        try:
            self.cgroups.attach(session.id, pid, limits.max_memory_mb, limits.max_processes,
                                uid=session.meta.owner_uid, share=self.share())
        except OSError as exc:
            tagged(log, session.id).warning("cannot put worker %d in its cgroup: %s", pid, exc)
            return
        self._oom_seen[session.id] = self.cgroups.oom_mark(session.id)
        fd = self.cgroups.oom_fd(session.id)
        if fd is not None:
            self._oom.watch(session.id, fd, lambda: self._on_oom(session))

    def limit(self, session: Session) -> None:
        """New limits for a live session (a reload), its owner's share too."""
        if self.cgroups is not None:
            limits = session.settings.agent.limits
            self.cgroups.limit(session.id, limits.max_memory_mb, limits.max_processes, self.share())

    def _on_oom(self, session: Session, tries: int = 0) -> None:
        """A memory ceiling was met in or above the session (an eventfd on
        v1's memory.oom_control, signalled as the OOM begins, for every
        cgroup below the one at its limit, and also when the cgroup goes):
        once the kernel says which, the session (or its owner's largest)
        goes."""
        worker = session.worker
        if worker is None or worker.kill_reason is not None or worker.exited.done():
            return
        if not self.oom_check(session, worker) and tries < _OOM_CHECKS:
            asyncio.get_running_loop().call_later(_OOM_CHECK_SECS, self._on_oom, session, tries + 1)

    def oom_check(self, session: Session, worker: WorkerProc, dead: bool = False) -> bool:
        """Act on an OOM since the worker came, told by its ceiling: kill the
        session whole (its own cap, the daemon's ceiling), or its owner's
        largest session (the owner's share).  Classified `killed_memory`.
        `dead`: the worker has exited (the kernel's kill took it)."""
        if self.cgroups is None or worker.kill_reason is not None:
            return False
        cause = self.cgroups.oom_cause(session.id, self._oom_seen.get(session.id, OomMark()))
        if cause is None:
            return False
        limits = session.settings.agent.limits
        if cause == "user":
            return self._user_share_met(session, dead)
        used = (self.cgroups.memory_bytes(session.id) or 0) / MIB
        if cause == "own":
            cap = limits.max_memory_mb
            used = used or cap
            over = f"exceeded at {figure_past(used, cap)} MiB" if used > cap else "reached"  # (usage stops at the cap)
            return self._memory_kill(session, worker, used, cap, "",
                                     f"memory cap {cap} MiB {over} (the kernel's cgroup limit)")
        assert self.ceilings is not None
        ceiling = self.ceilings.memory
        return self._memory_kill(
            session, worker, used, ceiling.limit / MIB, "daemon memory ceiling",
            f"the kernel's OOM killer killed a process of it at {used:.0f} MiB: the daemon's memory "
            f"ceiling ({ceiling.limit // MIB} MiB, {ceiling.where}: the unit's MemoryMax=) was reached by all "
            f"sessions together, not this session's cap (max_memory_mb = {limits.max_memory_mb})")

    def _memory_kill(self, session: Session, worker: WorkerProc, used: float, limit: float, ceiling: str,
                     detail: str) -> bool:
        """One kill for memory: told (LimitExceeded, naming the ceiling when
        it is not the session's own cap), then the whole session."""
        self._events.emit_limit(session, LimitKind.MEMORY, used, limit, ceiling=ceiling)
        self._kill(session, worker, ExitReason.KILLED_MEMORY, detail)
        return True

    def _user_share_met(self, session: Session, dead: bool) -> bool:
        """The owner's sessions together are at its share: the largest of
        them goes (v1 holds them all at the share until then; v2's kernel
        has killed one already, which is this one when it is dead)."""
        cgroups = self.cgroups
        assert cgroups is not None
        uid = session.meta.owner_uid
        share = self.share().memory_mb
        held = (cgroups.user_memory_bytes(uid) or share * MIB) / MIB
        if dead:
            victim = session  # the kernel's victim (v2's, a whole session), told why
        else:
            mine = [s for s in self._live() if s.meta.owner_uid == uid and s.worker is not None
                    and s.worker.kill_reason is None and not s.worker.exited.done()]
            victim = max(mine or [session], key=lambda s: cgroups.memory_bytes(s.id) or 0)
        target = victim.worker
        if target is None or target.kill_reason is not None:
            return True
        return self._memory_kill(
            victim, target, held, share, _SHARE_KEY,
            f"the sessions of uid {uid} together reached their memory share ({_SHARE_KEY} = {share} MiB) "
            f"at {held:.0f} MiB: its largest session was killed, not its own cap "
            f"(max_memory_mb = {victim.settings.agent.limits.max_memory_mb})")

    def release(self, session: Session, pid: int) -> None:
        """Kill what is left of the session by what a process cannot shed:
        its cgroup, else its own uid (a root daemon's session uid); then
        the IPC objects that uid left.  Not for a worker on another
        machine (cluster mode): its uid's processes here, if any, are not
        its, and its node host kills its tree."""
        if self.cgroups is None:
            uid = session.meta.run_uid
            if (uid is not None and self._workspaces.session_uids is not None and os.geteuid() == 0
                    and pid < REMOTE_PIDS):
                kill_uid(uid)
        else:
            self._oom.unwatch(session.id)
            self._oom_seen.pop(session.id, None)
            self.cgroups.release(session.id)
        self._workspaces.ended(session, here=pid < REMOTE_PIDS)
