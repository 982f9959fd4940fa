"""What a client is told about a session (`SessionInfo`: `status`, `ls`,
`create`'s answer), gathered from the parts that own each figure.

Runs in the daemon's loop.  Reads only: the last sweep's memory figure (or
a measure now, for a worker not swept yet), the spawner's placement, the
worker's sandbox report, the budgets' figures, the ledger's waiting asks.
"""

from __future__ import annotations

from ipc import messages as m
from supervisor.core.budgets import Budgets, tokens_of
from supervisor.core.ledger import TurnLedger
from supervisor.core.limits import ProcTable
from supervisor.spawn.seams import Spawner
from supervisor.core.session import Session
from supervisor.core.workers import WorkerOwner

__all__ = ["session_info"]


def session_info(session: Session, workers: WorkerOwner, spawner: Spawner, proc_table: ProcTable, budgets: Budgets,
                 ledger: TurnLedger, with_rss: bool = True) -> m.SessionInfo:
    """The session as `status` and `ls` tell it: its state, its worker
    (where it runs, what it holds), its turns, spend and waiting asks."""
    worker = session.worker
    pid = worker.pid if worker is not None and not worker.exited.done() else None
    rss: int | None = None
    if pid is not None and with_rss and workers.measured:  # (blind: unknown, never 0)
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
        sandbox=workers.sandbox_report(worker) if pid is not None and worker is not None else {},
        disk_bytes=session.memory.disk_bytes, cpu_percent=session.memory.cpu_percent if pid is not None else None,
        budget=budgets.figures(session), disk_inodes=session.memory.disk_inodes,
        waiting=ledger.waiting(session),
    )
