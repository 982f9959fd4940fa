"""What a client is told about a session (`SessionInfo`: `status`, `ls`,
`create`'s answer), gathered from the parts that own each figure; and how
the workers are confined on this host (`stats`).

Runs in the daemon's loop.  Reads only: the last sweep's memory figure (or
a measure now, for a worker not swept yet), the spawner's placement, the
worker's sandbox report, the budgets' figures, the ledger's waiting asks.
"""

from __future__ import annotations

from typing import Any

from ipc import messages as m
from ipc.settings import SandboxSettings
from supervisor.spawn import sandbox
from supervisor.spawn.cgroups import Cgroups
from supervisor.core.budgets import Budgets, tokens_of
from supervisor.core.ledger import TurnLedger
from supervisor.host.proctable import ProcTable
from supervisor.spawn.seams import Spawner
from supervisor.core.session import Session, WorkerProc
from supervisor.core.workers import WorkerOwner

__all__ = ["host_confinement", "session_info"]


def session_info(session: Session, workers: WorkerOwner, spawner: Spawner, proc_table: ProcTable, budgets: Budgets,
                 ledger: TurnLedger, with_rss: bool = True) -> m.SessionInfo:
    """The session as `status` and `ls` tell it: its state, its worker
    (where it runs, what it holds), its turns, spend and waiting asks."""
    worker = session.worker
    pid = worker.pid if worker is not None and not worker.exited.done() else None
    rss: int | None = None
    if pid is not None and with_rss and _measured(workers.sandbox):  # (blind: unknown, never 0)
        # The last sweep's figure (at most one poll interval old); a worker
        # not swept yet is measured now.
        rss = session.memory.rss_bytes or session.memory.measure(proc_table, pid)
    node_pid, node = spawner.placement(pid) if pid is not None else (None, None)
    return m.SessionInfo(
        id=session.id, state=session.state.value, handler=session.meta.handler, pid=node_pid, node=node,
        rss_bytes=rss, restarts=session.restarts, turns=session.turns,
        created_at=session.meta.created_at, last_exit=session.last_exit, seq=session.seq,
        parent=session.meta.parent, children=list(session.children),
        owner_uid=session.meta.owner_uid, error=session.error, usage=tokens_of(session.usage),
        sandbox=_sandbox_report(worker, workers.cgroups) if pid is not None and worker is not None else {},
        disk_bytes=session.memory.disk_bytes, cpu_percent=session.memory.cpu_percent if pid is not None else None,
        budget=budgets.figures(session), disk_inodes=session.memory.disk_inodes,
        waiting=ledger.waiting(session),
    )


def host_confinement(settings: SandboxSettings, boot: m.SandboxBoot | None, cgroups: Cgroups | None,
                     cgroups_why: str) -> dict[str, Any]:
    """The daemon-wide part of `stats` that is the workers' confinement
    (`boot`: what the daemon found at start for confining tools; None: off)."""
    described = cgroups.describe() if cgroups is not None else ""
    return sandbox.summary(settings, boot, described, cgroups_why)


def _measured(boot: m.SandboxBoot | None) -> bool:
    """Whether the daemon can read its workers' figures: not where their
    /proc entries are hidden from it and no cgroup counts them."""
    return boot is None or not boot.unmeasured


def _sandbox_report(worker: WorkerProc, cgroups: Cgroups | None) -> dict[str, Any]:
    """The worker's own report, plus the cgroup the daemon put it in."""
    if cgroups is None:
        return worker.sandbox
    active = [*worker.sandbox.get("active", []), *(f"cgroup-{c}" for c in sorted(cgroups.controllers)), "cgroup-kill"]
    return {**worker.sandbox, "active": active}
